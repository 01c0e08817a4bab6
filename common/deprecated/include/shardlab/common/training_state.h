#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/checkpoint/training_state.h> since 0.2. This forwarder
// goes in 0.3.
#warning "<shardlab/common/training_state.h> is deprecated: include <shardlab/core/checkpoint/training_state.h>"
#include <shardlab/core/checkpoint/training_state.h>
