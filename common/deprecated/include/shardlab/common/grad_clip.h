#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/model/grad_clip.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/grad_clip.h> is deprecated: include <shardlab/core/model/grad_clip.h>"
#include <shardlab/core/model/grad_clip.h>
