#pragma once
// What runs a strategy's steps (StepRunner) over any ParallelModel: micro-batches, no_sync or a deferred
// all-reduce, clipping, the optimizer, checkpoints, and the figures a wrapper has of its own (buckets, FSDP's
// measured memory and counters). A strategy builds its wrapper and hands it here.

#include "strategies.h"

#include "shardlab/comm_hooks/optimizer_overlap.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/parallel/parallel_model.h"

#include <functional>
#include <memory>

namespace shardlab::cli {

/// How the micro-batches of a step before the last keep their gradients local: null = ParallelModel::no_sync();
/// else called with false before each of them and with true before the last (HSDP's deferred all-reduce).
using MicroBatchHook = std::function<void(bool last)>;

/// The single-device "wrapper" of `model`: no communication at all; checkpoints through a group of one rank.
std::unique_ptr<ParallelModel> single_device(std::shared_ptr<Model> model);

/// Runs `wrapper` (over `model`): an optimizer `c.optimizer` over wrapper->parameters(), or, with `overlapped`
/// (stage 03's hook_then_optimizer, already in the wrapper's reducer), none: the synchronized backward steps the
/// parameters itself. Reads the wrapper's facets where it has them: its measured memory (MemoryFacet), its buckets
/// and their tuned caps (bucketed_ddp::AutoCaps), and its work after the optimizer's step (StepSeam, called after
/// every step).
std::unique_ptr<StepRunner> wrapped_runner(const TrainConfig& c, std::shared_ptr<Model> model,
                                           std::unique_ptr<ParallelModel> wrapper,
                                           std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped = nullptr,
                                           MicroBatchHook accumulation = nullptr);

}  // namespace shardlab::cli
