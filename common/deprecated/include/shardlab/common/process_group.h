#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/comm/process_group.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/process_group.h> is deprecated: include <shardlab/core/comm/process_group.h>"
#include <shardlab/core/comm/process_group.h>
