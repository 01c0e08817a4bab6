#pragma once
/// @file comm_hook.h
/// Stage 03 — communication hooks: *how* a gradient is averaged over the ranks, as a small replaceable function.
///
/// Stage 02 averages each bucket with `all_reduce(bucket, AVG)`. A communication hook replaces that one call: it
/// receives the gradient (and, in the reduce-scatter form, the shard it must fill), starts the collective, and
/// returns a Handle whose `wait()` leaves the average in place. Hooks are called during backward, so a hook never
/// blocks: the work after the collective (post-division, cast back) runs in the Handle's `then` step.
///
/// Vocabulary:
///  - *all-reduce form*: `output` is undefined; after `wait()` the gradient itself holds the average over ranks.
///  - *reduce-scatter form*: `output` is defined and has `grad.numel() / world_size` elements; after `wait()` it
///    holds chunk `rank` of the average (FSDP's gradient shard). `grad` is then scratch: its contents afterwards
///    are unspecified (it may hold the pre-divided gradient).
///  - *pre-divide / post-divide factor*: the average `sum / W` is computed as `sum(g / pre) / post` with
///    `pre * post == W`, so that neither the sum of large values overflows nor the division of small values
///    underflows, which matters most in fp16. See Note [Pre- and post-division] in comm_hook.cpp.
///  - *low precision*: the fp16 / bf16 hooks communicate a half-size copy of the gradient and cast the average
///    back into the gradient's (the parameter's) dtype.
///
/// References: PyTorch FSDP's default hooks (torch/distributed/algorithms/_comm_hooks/default_hooks.py:
/// DefaultState, allreduce_hook, reduce_scatter_hook, fp16_compress_hook, bf16_compress_hook); PyTorch DDP's
/// `register_comm_hook` and its fp16 compression hook.

#include "shardlab/bucketed_ddp/bucket_reducer.h"
#include "shardlab/core/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace shardlab::comm_hooks {

/// The pre-divide factor for `world_size` ranks (FSDP's rule, PyTorch FSDP1's `_get_gradient_predivide_factor`):
/// a power of two of roughly sqrt(world_size), grown by doubling from 1.
/// Examples: 1 -> 1, 2 -> 2, 3 -> 2, 4 -> 2, 6 -> 4, 8 -> 4, 9 -> 2, 16 -> 4.
/// @throws std::invalid_argument when world_size < 1.
double gradient_predivide_factor(int world_size);

/// State shared by the built-in hooks (FSDP's DefaultState): the group and the two division factors.
struct DefaultState {
  /// Binds the state to `comm` and computes the factors: pre from gradient_predivide_factor(comm.size()),
  /// post = world_size / pre. `comm` must outlive the state.
  explicit DefaultState(Communicator& comm);

  Communicator* comm;                 ///< the group every collective of the hook runs on (not owned)
  int world_size;                     ///< comm->size()
  double gradient_predivide_factor;   ///< divides each rank's gradient before the sum (skipped when 1)
  double gradient_postdivide_factor;  ///< divides the sum after the collective (skipped when 1)
};

/// A communication hook: state + gradient (+ output shard) -> asynchronous handle.
/// With `output` undefined (all-reduce form), `grad` holds the average over ranks after `wait()`; with `output`
/// defined (reduce-scatter form), `output` (grad.numel() / world_size elements) holds this rank's chunk of the
/// average. Must not block: it is called on the backward thread.
using HookFn = Handle (*)(DefaultState& state, const at::Tensor& grad, const at::Tensor& output);

/// Averages `grad` in place: pre-divide, all-reduce (SUM) in grad's dtype, post-divide on `wait()`.
/// @pre grad is a defined, contiguous, floating tensor; `output` is undefined (use reduce_scatter_hook for shards).
/// @throws std::invalid_argument naming what was expected and what came.
Handle allreduce_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output);

/// Leaves chunk `rank` of the average of `grad` in `output`: pre-divide `grad` in place, reduce-scatter (SUM),
/// post-divide `output` on `wait()`.
/// @pre grad is a defined, contiguous, floating tensor; output is contiguous, has grad's dtype and device, and
///      grad.numel() == world_size * output.numel().
/// @throws std::invalid_argument naming what was expected and what came.
Handle reduce_scatter_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output);

/// Like allreduce_hook / reduce_scatter_hook (either form, chosen by `output`) but communicates in float16: casts
/// the gradient to fp16, pre-divides and sums in fp16, post-divides in fp16 on `wait()`, then casts the result
/// back into `grad` (all-reduce form) or `output` (reduce-scatter form), whose dtype is kept. Half the bytes of
/// fp32 on the wire; fp16's range is small (max 65504), which is what the pre-division is for.
/// @throws std::invalid_argument as the fp32 hooks do.
Handle fp16_compress_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output);

/// Like fp16_compress_hook, in bfloat16 (fp32's range, 8 bits of mantissa). A backend that cannot reduce bf16
/// (Gloo 1.13) gets it as float32 from the Communicator (see Note [Fallbacks] in collectives.cpp): the result is
/// the same as a bf16 reduction that sums in f32, but the bytes on the wire are those of f32 (the CommRecorder
/// shows wire_dtype float); `Communicator::reduces_natively(at::kBFloat16)` tells which case applies.
/// @throws std::invalid_argument as the fp32 hooks do.
Handle bf16_compress_hook(DefaultState& state, const at::Tensor& grad, const at::Tensor& output);

/// A hook bound to its state: what a DDP (and, later, FSDP) wrapper holds and calls.
struct CommHook {
  std::string name;                     ///< e.g. "fp16"; used in error messages and reports
  std::shared_ptr<DefaultState> state;  ///< shared by every call of this hook
  HookFn fn;                            ///< the hook itself

  /// Calls `fn(*state, grad, output)`: all-reduce form when `output` is undefined, reduce-scatter form otherwise.
  /// @throws std::invalid_argument when `state` or `fn` is null, or whatever `fn` throws for bad arguments.
  Handle operator()(const at::Tensor& grad, const at::Tensor& output = {}) const;
};

/// Bytes `hook` holds privately, beyond its grad and output, while a reduce-scatter-form call on `grad_numel`
/// elements of `dtype` on `device` is in flight: a low-precision hook's copy of grad in its own dtype (none when
/// grad already is in it) and its reduced chunk (always), and what the Communicator holds for the reduce-scatter it
/// issues (Communicator::reduce_scatter_scratch_bytes). Memory meters add it (stage 04's FSDP does).
int64_t reduce_scatter_scratch_bytes(const CommHook& hook, c10::ScalarType dtype, int64_t grad_numel,
                                     c10::Device device);

/// The names make_hook accepts, in a stable order: "allreduce", "reduce_scatter", "fp16", "bf16".
const std::vector<std::string>& hook_names();

/// Builds the built-in hook `name` with a fresh DefaultState on `comm` (which must outlive the hook).
/// @throws std::invalid_argument listing the accepted names when `name` is unknown.
CommHook make_hook(const std::string& name, Communicator& comm);

/// Adapts an all-reduce-form hook to stage 02's extension point: `Options::reducer = as_bucket_reducer(hook)`
/// makes BucketedDDP average each bucket with the hook. The reducer checks that BucketedDDP's Communicator is the
/// one the hook's state is bound to.
/// @throws std::invalid_argument for a hook without state or function, or for "reduce_scatter" (a bucket is
///         averaged whole; it has no output shard).
bucketed_ddp::BucketReducer as_bucket_reducer(CommHook hook);

}  // namespace shardlab::comm_hooks
