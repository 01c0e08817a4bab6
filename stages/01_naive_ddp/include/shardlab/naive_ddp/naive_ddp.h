#pragma once
/// @file naive_ddp.h
/// Stage 01 — naive data parallelism: one all-reduce per parameter gradient.
///
/// This is the naive version, kept because it is the clearest statement of what data parallelism must do; stage
/// 02 (bucketed DDP) does the same with far fewer, larger collectives.
///
/// Vocabulary:
///  - *replica*: one rank's full copy of the model. All replicas hold identical parameters at all times.
///  - *synchronize a gradient*: replace every rank's `.grad` by the average of all ranks' `.grad`.
///  - *gradient accumulation*: several backward passes (micro-batches) before one optimizer step; only the last
///    one synchronizes (see `no_sync`).
///
/// Why averaging is exact: each rank's loss is the mean over its B/W examples, so the average of the W gradients
/// is the gradient of the mean loss over all B examples — what a single device would compute.
///
/// References: picotron DataParallelNaive (and its issue #39: the hook must see the accumulated gradient, and
/// must all-reduce the gradient, not the parameter); PyTorch DDP `no_sync`.

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/grad_ready.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/model/no_sync.h"
#include "shardlab/core/parallel/parallel_model.h"
#include "shardlab/naive_ddp/broadcast_state.h"

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::naive_ddp {

/// Wraps a Model so that gradients are averaged over the ranks of a Communicator after every backward pass.
///
/// Contract:
///  - Construct on every rank with a model of the same structure; construction broadcasts every parameter and
///    buffer from rank 0, so all replicas start identical (a collective: all ranks must construct).
///  - After `loss(batch).backward()` returns, every parameter that received a gradient holds the average over
///    ranks in `.grad()`; parameters that got no gradient, and frozen parameters, are never communicated.
///  - Every rank must produce gradients for the same parameters in the same backward pass (else a collective
///    times out and backward throws).
///  - The model and the Communicator must outlive the NaiveDDP. Not copyable or movable (hooks point to it).
class NaiveDDP : public ReplicatedModel {
 public:
  /// Broadcasts `module`'s parameters and buffers from rank 0 and watches every trainable parameter's gradient
  /// (a GradientReadiness calls `on_gradient_ready(i)` and, once per backward, `finish_sync()`).
  /// @param module the model to replicate; NaiveDDP shares ownership.
  /// @param comm the data-parallel group; its recorder sees every collective.
  NaiveDDP(std::shared_ptr<Model> module, Communicator& comm);
  ~NaiveDDP() override;
  NaiveDDP(const NaiveDDP&) = delete;
  NaiveDDP& operator=(const NaiveDDP&) = delete;

  /// The wrapped model's mean loss on this rank's `batch`; call `.backward()` on it to train.
  /// If the previous backward was aborted (an exception) before its end-of-backward callback ran, this first
  /// waits for the all-reduces it had launched, so a failed step cannot leave work pending into the next one.
  at::Tensor loss(const Batch& batch) override;
  /// The wrapped model (for the optimizer and for checkpoints).
  Model& module() { return *module_; }

  /// Skips communication for backward passes run while the returned scope lives: gradients accumulate locally
  /// (and differ across ranks). The first backward after the scope synchronizes the accumulated gradients.
  /// @code
  ///   { auto scope = ddp.no_sync(); ddp.loss(mb0).backward(); }   // local accumulation
  ///   ddp.loss(mb1).backward();                                   // accumulated grads are averaged here
  /// @endcode
  [[nodiscard]] NoSync no_sync() override { return NoSync(sync_enabled_); }

  /// True unless inside a `no_sync` scope.
  bool sync_enabled() const { return sync_enabled_; }

  /// Clips the gradients by their global p-norm, as torch.nn.utils.clip_grad_norm_ (grad_clip.h): call it between
  /// backward and the optimizer's step, on every rank. After a synchronized backward every rank holds the whole
  /// averaged gradient, so no collective runs and every rank computes the same norm and scale.
  /// @param max_norm the bound on the total norm (>= 0).
  /// @param p 2 by default; infinity (std::numeric_limits<double>::infinity()) for the largest |g|.
  /// @return the total norm before clipping.
  /// @throws std::logic_error inside no_sync (the gradients are this rank's own, not averaged yet);
  ///         std::invalid_argument for a negative max_norm or a p that is not positive.
  double clip_grad_norm(double max_norm, double p = 2.0) override;

  /// Saves the model and `optimizer`'s state (null: the model only) as a sharded checkpoint in `dir`, replacing the
  /// one there atomically (training_state.h, checkpoint.h). Every rank holds the same replica: rank 0 writes it.
  /// `metadata` (rank 0's) is saved alongside. A collective: every rank calls it, between steps.
  /// @param dir the checkpoint's directory (on a filesystem every rank sees).
  /// @param optimizer built over parameters(); null to save the model only.
  /// @param metadata strings to keep with the checkpoint (the step, the data position).
  /// @throws as save_training_checkpoint, on every rank alike.
  void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                       const std::map<std::string, std::string>& metadata = {}) override;
  /// Loads a checkpoint saved by any wrapper at any world size (or a full safetensors file) into the model and,
  /// when not null, `optimizer`; all or nothing. A collective: every rank calls it, between steps.
  /// @param path the checkpoint's directory, or a safetensors file.
  /// @param optimizer built over parameters(); null to load the model only.
  /// @param optimizer_if_saved true: a checkpoint of weights only (exported, or from PyTorch) loads the model and
  ///        leaves `optimizer` as it is (load_training_checkpoint).
  /// @param names the model's name of each saved tensor, for a file named otherwise (a Hugging Face file's dotted
  ///        names; checkpoint.h's SavedNames); empty: the saved names. A tied weight loads under any of its names.
  /// @return the saved metadata.
  /// @throws as load_training_checkpoint, on every rank alike, before anything changes.
  std::map<std::string, std::string> load_checkpoint(const std::string& path, torch::optim::Optimizer* optimizer,
                                                     bool optimizer_if_saved = false,
                                                     const SavedNames& names = {}) override;

 protected:
  /// ReplicatedModel: the replica this rank holds.
  const Model& replica() const override { return *module_; }

 private:
  // ---- Task 2: gradient synchronization. The given code calls these two; the state they share is yours (below).
  /// Called by the GradientReadiness each time autograd has accumulated `params_[index].grad()`, on the backward
  /// thread. Outside `no_sync`: starts averaging that gradient over the ranks and returns without waiting, and makes
  /// sure `finish_sync` runs when this backward ends. Inside `no_sync`: does nothing.
  void on_gradient_ready(size_t index);
  /// Waits for every average started and not yet waited for; afterwards none is pending. Called at the end of a
  /// synchronized backward (by finish_sync), before the forward that follows a backward cut short, and by the
  /// destructor. A failed collective's error comes out of it.
  void wait_pending();
  /// The end-of-backward callback, and the settling of a backward cut short (given): wait_pending(), timed as
  /// exposed communication.
  void finish_sync();

  std::shared_ptr<Model> module_;
  Communicator& comm_;
  std::vector<at::Tensor> params_;  // trainable parameters, registration order
  bool sync_enabled_ = true;        // false inside a no_sync scope
  // TODO(stage01): the state that on_gradient_ready and wait_pending share
  std::unique_ptr<GradientReadiness> readiness_;  // the hooks; declared last, so they go first
};

}  // namespace shardlab::naive_ddp
