#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/numbers.h> since 0.2. This forwarder goes in 0.3.
#warning "<shardlab/common/numbers.h> is deprecated: include <shardlab/core/numbers.h>"
#include <shardlab/core/numbers.h>
