#pragma once
/// @file optimizer_overlap.h
/// Stage 03 — the optimizer overlapped with communication ("hook, then optimizer").
///
/// Plain data parallelism waits for every bucket at the end of backward and only then steps the optimizer over
/// all parameters. But SGD, Adam and AdamW update each parameter from its own gradient and state alone: a bucket's
/// parameters can be stepped the moment that bucket's average has landed, while later buckets (the last one holds
/// the embeddings, ready only at the very end of backward) are still on the wire. This wraps any bucket reducer
/// (stage 02's average, or a stage 03 hook) so that its handle's continuation steps the bucket's parameters: the
/// end of backward then leaves every parameter already updated, and the step that follows has nothing to wait for.
///
/// What cannot be split this way is refused, never computed wrong: an optimizer whose update of one parameter
/// reads others (LBFGS: a closure over the whole model and a line search), and anything that needs every gradient
/// before any step (clipping by the global norm).
///
/// References: PyTorch DDP's `_hook_then_optimizer` (torch/distributed/algorithms/ddp_comm_hooks/
/// optimizer_overlap_hooks.py) and "apply optimizer in backward" (torch/distributed/optim/
/// apply_optimizer_in_backward.py), in the seed's 003 task.

#include "shardlab/bucketed_ddp/bucket_reducer.h"
#include "shardlab/core/comm/comm_record.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardlab::comm_hooks {

/// Builds an optimizer over the given parameters (called once per parameter).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

/// Steps parameters bucket by bucket: one optimizer per parameter, built by the same factory, so each parameter's
/// update is exactly what one optimizer over all of them computes (SGD with momentum, Adam, AdamW, Adagrad,
/// RMSprop keep per-parameter state only), bit for bit.
///
/// Contract:
///  - `step_bucket(flat)` steps exactly the parameters whose `.grad()` lies inside `flat` (a slice of a
///    BucketedDDP gradient buffer), each once; called by the reducer `hook_then_optimizer` returns.
///  - The parameters and their optimizers' state live as long as this object; share it (std::shared_ptr) with the
///    reducer.
class OverlappedOptimizer {
 public:
  /// One optimizer per parameter of `params` (trainable, registration order: BucketedDDP::parameters()).
  /// @param params the parameters to step; their gradients must live in the buckets' flat buffers.
  /// @param factory builds one optimizer over a list of parameters; called once per parameter.
  /// @param max_grad_norm a clipping norm; any value > 0 is refused (clipping by the global norm needs every
  ///        gradient before the first step, which is exactly what the overlap gives up).
  /// @throws std::invalid_argument for no parameters, a null factory or optimizer, an optimizer that is not
  ///         per-parameter (e.g. LBFGS), or a clipping norm; the message says what to do instead.
  OverlappedOptimizer(std::vector<at::Tensor> params, const OptimizerFactory& factory, double max_grad_norm = 0);

  /// Steps every parameter whose gradient lies in `flat`, in the order of `params`, and logs the call.
  /// @throws std::invalid_argument when no parameter's gradient lies in `flat` (not a bucket of these parameters).
  void step_bucket(const at::Tensor& flat);
  /// From now on step_bucket marks its time as busy in `recorder` (CommRecorder::record_busy): an optimizer step
  /// inside the end-of-backward wait is work, not exposed communication. `recorder` must outlive this object.
  void report_to(CommRecorder& recorder) { recorder_ = &recorder; }
  /// Zeroes every gradient in place (they stay in their buckets' slots).
  void zero_grad();

  /// One entry per step_bucket call: which parameters it stepped, and when (now_ns) it began and ended.
  struct BucketStep {
    std::vector<size_t> params;  ///< indices into the parameters, in order
    int64_t start_ns = 0;        ///< now_ns() when the call began
    int64_t end_ns = 0;          ///< now_ns() when it ended
  };
  /// Every step_bucket call so far, in order.
  const std::vector<BucketStep>& log() const { return log_; }
  /// The optimizer of parameter `index` (for checkpoints and tests).
  torch::optim::Optimizer& optimizer(size_t index) { return *optimizers_.at(index); }
  /// How many parameters (and optimizers) there are.
  size_t size() const { return params_.size(); }

 private:
  std::vector<at::Tensor> params_;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers_;
  std::vector<BucketStep> log_;
  CommRecorder* recorder_ = nullptr;
};

/// A BucketReducer for `bucketed_ddp::Options::reducer`: `reduce` (null: the plain average over the group), and,
/// when its handle has landed, `optimizer->step_bucket` of that bucket, in the handle's continuation. Buckets are
/// waited for in launch order at the end of backward, so bucket k's parameters are updated while buckets after k
/// are still in flight, and backward returns with every parameter updated: do not call an optimizer step after it.
/// Inside `no_sync` no bucket is reduced, hence nothing is stepped: only the synchronized backward steps. A
/// backward that fails (a parameter without gradient) or is cut short (an exception in backward) steps nothing: its
/// buckets are still waited for (bucketed_ddp::settling_a_complete_backward() is false then), the parameters stay as
/// they were. A collective that fails while a complete backward settles is different: the buckets before it were
/// stepped, and wait_all goes on waiting for (and stepping) the rest before backward rethrows the failure. Waited
/// for outside BucketedDDP's end of backward, the returned reducer's handles step nothing.
/// @throws std::invalid_argument for a null optimizer.
bucketed_ddp::BucketReducer hook_then_optimizer(bucketed_ddp::BucketReducer reduce,
                                                std::shared_ptr<OverlappedOptimizer> optimizer);

}  // namespace shardlab::comm_hooks
