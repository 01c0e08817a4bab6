#pragma once
/// @file bucketed_ddp.h
/// Stage 02 — bucketed data parallelism: gradients in flat buckets, one asynchronous all-reduce per bucket,
/// started during backward as soon as the bucket is complete.
///
/// Stage 01 sends one message per parameter (26 for the tiny GPT); every message pays a fixed latency. Here the
/// gradients live in one flat buffer per dtype, each parameter's `.grad()` sharing its memory (a slot, not an
/// autograd view), so a bucket is a contiguous slice that can be all-reduced as one tensor, without any copy after
/// backward.
///
/// Life of one synchronized backward:
///  1. A post-accumulate hook marks a parameter ready; when every parameter of a bucket is ready, and every
///     earlier bucket has been launched, the bucket's all-reduce starts (buckets are launched strictly in order,
///     so the collectives match across ranks).
///  2. At the end of backward one queued callback launches what remains (unused parameters), waits for every
///     bucket and leaves the averaged gradients in `.grad()`.
///  3. The first time, the order in which gradients really became ready is recorded; at the next forward, rank 0
///     broadcasts it and every rank rebuilds its buckets in that order (PyTorch DDP's bucket rebuild).
///
/// References: picotron DataParallelBucket (flat main_grad buffers, bucket manager, post-backward callback);
/// PyTorch DDP's C++ Reducer (bucket caps, the small first bucket, rebuild from the ready order,
/// find_unused_parameters and its "Expected to have finished reduction" error).

#include "shardlab/bucketed_ddp/bucket_plan.h"
#include "shardlab/bucketed_ddp/bucket_reducer.h"
#include "shardlab/bucketed_ddp/cap_tuning.h"
#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/grad_ready.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/model/no_sync.h"
#include "shardlab/core/parallel/parallel_model.h"

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::bucketed_ddp {

/// How BucketedDDP builds and reduces its buckets.
struct Options {
  BucketCaps caps;                      ///< byte caps (first bucket 1 MiB, later 25 MiB by default)
  bool find_unused_parameters = false;  ///< false: a parameter without gradient is an error naming it
  bool rebuild_buckets = true;          ///< rebuild once from the real gradient-ready order (ready_order())
  BucketReducer reducer;                ///< null: `comm.all_reduce(bucket, ReduceOp::kAvg)`
};

/// One bucket: a contiguous slice of the flat gradient buffer of its dtype.
struct Bucket {
  c10::ScalarType dtype;       ///< dtype of every parameter in it
  std::vector<size_t> params;  ///< indices into BucketedDDP::parameters(), in layout order
  int64_t offset = 0;          ///< first element of the slice in the dtype's flat buffer
  int64_t numel = 0;           ///< elements in the slice (sum of the parameters' numel)
  at::Tensor flat;             ///< the slice itself (a view of the buffer)
};

/// Wraps a Model so that gradients are averaged over the ranks of a Communicator, bucket by bucket, overlapped
/// with backward.
///
/// Contract:
///  - Construct on every rank with a model of the same structure; construction broadcasts every parameter and
///    buffer from rank 0 (a collective).
///  - Call `loss(batch)` (the forward) before each backward. After `backward()` returns outside `no_sync`, every
///    trainable parameter's `.grad()` holds the average over ranks; it shares storage with a flat buffer
///    (`grad_buffer`). Zeroing grads in place keeps them there; a `.grad()` that something dropped (libtorch 2.x
///    `zero_grad`) or replaced is put back into its slot by the next `loss()` or when its gradient arrives: a
///    dropped one as zeros, a replaced one with its values.
///  - A forward under `NoGradGuard` (evaluation) runs no collective and may run on some ranks only.
///  - Double backward (`create_graph = true`) is not supported: backward throws std::invalid_argument naming the
///    parameter and `create_graph`.
///  - The trainable parameters are fixed at construction: unfreezing one later does not add it to a bucket.
///  - Every trainable parameter must receive a gradient in every synchronized backward, unless
///    `find_unused_parameters` is set; otherwise backward throws std::runtime_error naming the parameters
///    ('c.weight', 'c.bias': in index order) and `find_unused_parameters`, once every bucket was reduced (another
///    rank may have had those gradients). Names in errors are quoted the same way everywhere.
///  - A parameter becomes ready at most once per synchronized backward. One that becomes ready twice (with
///    `find_unused_parameters`, two losses summed, the later one not using it: marked unused when backward reaches
///    that loss, then its gradient arrives) makes backward throw std::logic_error naming it ("became ready twice").
///  - Frozen parameters (requires_grad false) never enter a bucket.
///  - The model and the Communicator must outlive the BucketedDDP. Not copyable or movable (hooks point to it).
///  - It offers itself as the facet BucketedDDP (parallel/facets.h): a loop that holds any ParallelModel reaches
///    the buckets, caps and backward profile below as `wrapper.facet<bucketed_ddp::BucketedDDP>()`.
class BucketedDDP : public ReplicatedModel {
 public:
  /// Broadcasts the model's state from rank 0, lays gradients out in buckets (reverse registration order) and
  /// installs one post-accumulate hook per trainable parameter.
  /// @throws std::invalid_argument on a null model, non-positive caps, a model without trainable parameters, or
  ///         trainable parameters on more than one device.
  BucketedDDP(std::shared_ptr<Model> module, Communicator& comm, Options options = {});
  ~BucketedDDP() override;
  BucketedDDP(const BucketedDDP&) = delete;
  BucketedDDP& operator=(const BucketedDDP&) = delete;

  /// The forward: the wrapped model's mean loss on this rank's `batch`. Before it, settles a backward that ended
  /// early, applies a pending bucket rebuild (a collective) and re-attaches gradient views; with
  /// `find_unused_parameters`, marks the parameters the loss does not depend on as ready.
  at::Tensor loss(const Batch& batch) override;
  /// The wrapped model.
  Model& module();

  /// Skips communication for backward passes run while the returned scope lives (gradient accumulation); the
  /// first backward after it averages the accumulated gradients.
  [[nodiscard]] NoSync no_sync() override;
  /// True unless inside a `no_sync` scope.
  bool sync_enabled() const;
  /// Clips the gradients by their global p-norm, as NaiveDDP::clip_grad_norm: call it between
  /// backward and the optimizer's step (not with stage 03's overlapped optimizer, which steps inside backward and
  /// refuses a clipping norm). No collective.
  /// @param max_norm the bound on the total norm (>= 0).
  /// @param p 2 by default; infinity (std::numeric_limits<double>::infinity()) for the largest |g|.
  /// @return the total norm before clipping.
  /// @throws std::logic_error inside no_sync (the gradients are this rank's own, not averaged yet);
  ///         std::invalid_argument for a negative max_norm or a p that is not positive.
  double clip_grad_norm(double max_norm, double p = 2.0) override;

  /// Checkpoints, as NaiveDDP's (ParallelModel's contract): every rank holds the same replica, so rank 0 writes
  /// it; any wrapper at any world size loads it, all or nothing. Collectives: every rank calls them, between steps.
  /// The bucket layout is saved with the model and restored (Note [The bucket layout in a checkpoint]).
  void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                       const std::map<std::string, std::string>& metadata = {}) override;
  std::map<std::string, std::string> load_checkpoint(const std::string& path, torch::optim::Optimizer* optimizer,
                                                     bool optimizer_if_saved = false,
                                                     const SavedNames& names = {}) override;

  /// The trainable parameters (a tied weight once), in registration order (bucket indices refer to these): what
  /// the optimizer steps.
  std::vector<at::Tensor> parameters() const override;
  /// Their names ("block0.fc.weight").
  const std::vector<std::string>& parameter_names() const;
  /// The buckets, in launch order.
  const std::vector<Bucket>& buckets() const;
  /// The flat gradient buffer of `dtype` (undefined when no parameter has that dtype).
  at::Tensor grad_buffer(c10::ScalarType dtype) const;
  /// Parameter indices in the order their gradients became ready in the last synchronized backward whose buckets
  /// were all reduced, one that then threw for a missing gradient included (parameters without gradient come last).
  /// After the first such backward the buckets are rebuilt at the next training forward, on every rank alike:
  /// rank 0's order, broadcast.
  const std::vector<size_t>& ready_order() const;
  /// True once the buckets were rebuilt from a real ready order.
  bool rebuilt() const;
  /// steady_clock time (now_ns) at which the last synchronized backward finished computing gradients, i.e. when
  /// its end-of-backward callback began; an all-reduce that started earlier overlapped with backward.
  int64_t backward_compute_end_ns() const;
  /// The last synchronized backward that completed, as cap_tuning's model sees it: per parameter when its gradient
  /// became ready (now_ns; a parameter found unused: when compute ended), the ready order, the compute end.
  /// Empty (no parameters) before the first one.
  BackwardProfile last_backward_profile() const;
  /// The caps in use (Options::caps, or the last set_caps).
  BucketCaps caps() const;
  /// Lays the buckets out again with `caps`, in the last ready order (rank 0's), at the next training forward (a
  /// collective, like the first rebuild). Every rank must call it with the same caps between the same steps.
  /// @throws std::invalid_argument for a non-positive cap; std::logic_error before the first synchronized backward
  ///         has completed (there is no ready order yet).
  void set_caps(BucketCaps caps);
  /// True once set_caps chose the caps in use: in this run, or in the run whose checkpoint load_checkpoint took the
  /// layout of (Note [The bucket layout in a checkpoint]).
  bool caps_set() const;

 protected:
  /// ReplicatedModel: the replica this rank holds.
  const Model& replica() const override;

 private:
  // Your state: the open track gives none of the solution's members.
};

}  // namespace shardlab::bucketed_ddp
