#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/trace.h> since 0.2. This forwarder goes in 0.3.
#warning "<shardlab/common/trace.h> is deprecated: include <shardlab/core/trace.h>"
#include <shardlab/core/trace.h>
