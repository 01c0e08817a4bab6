#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/compat.h> since 0.2. This forwarder goes in 0.3.
#warning "<shardlab/common/compat.h> is deprecated: include <shardlab/core/compat.h>"
#include <shardlab/core/compat.h>
