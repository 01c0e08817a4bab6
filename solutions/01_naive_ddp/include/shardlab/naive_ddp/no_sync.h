#pragma once
/// @file no_sync.h
/// 0.1's path and name of the gradient-accumulation scope, for one release: it is shardlab::NoSync in
/// shardlab/core/model/no_sync.h since 0.2. This header goes in 0.3.

#include "shardlab/core/model/no_sync.h"

namespace shardlab::naive_ddp {

/// 0.1's name of shardlab::NoSync.
using NoSync = shardlab::NoSync;

}  // namespace shardlab::naive_ddp
