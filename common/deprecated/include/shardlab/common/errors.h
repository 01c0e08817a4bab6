#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/errors.h> since 0.2. This forwarder goes in 0.3.
#warning "<shardlab/common/errors.h> is deprecated: include <shardlab/core/errors.h>"
#include <shardlab/core/errors.h>
