#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/device/stream.h> since 0.2. This forwarder goes in 0.3.
#warning "<shardlab/common/stream.h> is deprecated: include <shardlab/core/device/stream.h>"
#include <shardlab/core/device/stream.h>
