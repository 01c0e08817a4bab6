#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/device/device.h> since 0.2. This forwarder goes in 0.3.
#warning "<shardlab/common/device.h> is deprecated: include <shardlab/core/device/device.h>"
#include <shardlab/core/device/device.h>
