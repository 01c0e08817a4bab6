#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/comm/text_gather.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/text_gather.h> is deprecated: include <shardlab/core/comm/text_gather.h>"
#include <shardlab/core/comm/text_gather.h>
