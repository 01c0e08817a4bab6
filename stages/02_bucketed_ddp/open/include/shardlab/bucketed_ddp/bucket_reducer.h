#pragma once
/// @file bucket_reducer.h
/// Stage 02 — the extension point later stages plug into: how one bucket is averaged, and whether the wait that
/// settles it belongs to a complete backward.
///
/// A header of its own (defined in bucketed_ddp.cpp) so that stage 03 includes it without bucketed_ddp.h, whose
/// private state is the student's (see Note [A starter's headers] in cmake/ShardLabStage.cmake).

#include "shardlab/core/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <functional>

namespace shardlab::bucketed_ddp {

/// Extension point (stage 03 plugs its communication hooks in here): averages one bucket's flat gradient over
/// the group, asynchronously. Called on the backward thread the moment the bucket is ready; when the returned
/// handle's `wait()` returns, `bucket` must hold the average over ranks, in its own dtype.
using BucketReducer = std::function<Handle(Communicator& comm, const at::Tensor& bucket)>;

/// True while BucketedDDP waits for the buckets of a backward that completes (every gradient came, or the missing
/// ones are allowed), on the thread doing so; false in every other wait (a backward that failed or was cut short,
/// the destructor). A reducer's continuation that must only run for a complete backward (stage 03's optimizer
/// step) checks it. See Note [Settling a complete backward] in bucketed_ddp.cpp.
bool settling_a_complete_backward();

}  // namespace shardlab::bucketed_ddp
