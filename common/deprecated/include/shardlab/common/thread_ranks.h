#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/comm/thread_ranks.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/thread_ranks.h> is deprecated: include <shardlab/core/comm/thread_ranks.h>"
#include <shardlab/core/comm/thread_ranks.h>
