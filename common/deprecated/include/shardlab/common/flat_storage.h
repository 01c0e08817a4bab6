#pragma once
// Deprecated path (shardlab 0.1): this header is <shardlab/core/storage/flat_storage.h> since 0.2. This forwarder goes
// in 0.3.
#warning "<shardlab/common/flat_storage.h> is deprecated: include <shardlab/core/storage/flat_storage.h>"
#include <shardlab/core/storage/flat_storage.h>
