#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/model/grad_ready.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/grad_ready.h> is deprecated: include <shardlab/core/model/grad_ready.h>"
#include <shardlab/core/model/grad_ready.h>
