#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/checkpoint/safetensors.h> since 0.2. This forwarder
// goes in 0.3.
#warning "<shardlab/common/safetensors.h> is deprecated: include <shardlab/core/checkpoint/safetensors.h>"
#include <shardlab/core/checkpoint/safetensors.h>
