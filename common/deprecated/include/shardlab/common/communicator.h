#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/comm/communicator.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/communicator.h> is deprecated: include <shardlab/core/comm/communicator.h>"
#include <shardlab/core/comm/communicator.h>
