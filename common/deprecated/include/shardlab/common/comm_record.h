#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/comm/comm_record.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/comm_record.h> is deprecated: include <shardlab/core/comm/comm_record.h>"
#include <shardlab/core/comm/comm_record.h>
