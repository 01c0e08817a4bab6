#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/storage/buffer_pool.h> since 0.2. This forwarder goes
// in 0.3.
#warning "<shardlab/common/buffer_pool.h> is deprecated: include <shardlab/core/storage/buffer_pool.h>"
#include <shardlab/core/storage/buffer_pool.h>
