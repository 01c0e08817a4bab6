#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/model/model_check.h> since 0.2. This forwarder goes in
// 0.3.
#warning "<shardlab/common/model_check.h> is deprecated: include <shardlab/core/model/model_check.h>"
#include <shardlab/core/model/model_check.h>
