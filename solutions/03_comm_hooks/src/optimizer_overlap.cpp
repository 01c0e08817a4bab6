#include "shardlab/comm_hooks/optimizer_overlap.h"

#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/errors.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <stdexcept>

namespace shardlab::comm_hooks {
namespace {

// Optimizers whose update of a parameter reads only that parameter, its gradient and its own state.
bool per_parameter(const torch::optim::Optimizer& opt) {
  return dynamic_cast<const torch::optim::SGD*>(&opt) || dynamic_cast<const torch::optim::Adam*>(&opt) ||
         dynamic_cast<const torch::optim::AdamW*>(&opt) || dynamic_cast<const torch::optim::Adagrad*>(&opt) ||
         dynamic_cast<const torch::optim::RMSprop*>(&opt);
}

}  // namespace

OverlappedOptimizer::OverlappedOptimizer(std::vector<at::Tensor> params, const OptimizerFactory& factory,
                                         double max_grad_norm)
    : params_(std::move(params)) {
  if (max_grad_norm > 0)
    throw std::invalid_argument(
        "OverlappedOptimizer: clipping by the global gradient norm (max_grad_norm " + std::to_string(max_grad_norm) +
        ") needs every gradient before the first parameter is stepped, and the overlap steps a bucket as soon as it "
        "lands; clip after backward and step a plain optimizer instead, or train without clipping");
  if (params_.empty()) throw std::invalid_argument("OverlappedOptimizer: expected parameters; got none");
  if (!factory) throw std::invalid_argument("OverlappedOptimizer: expected an optimizer factory; got a null one");
  for (const auto& p : params_) {
    auto opt = factory({p});
    if (!opt) throw std::invalid_argument("OverlappedOptimizer: the factory returned a null optimizer");
    if (!per_parameter(*opt))
      throw std::invalid_argument(
          "OverlappedOptimizer: expected an optimizer that updates each parameter from its own gradient and state "
          "(SGD, Adam, AdamW, Adagrad, RMSprop); got one that is not (e.g. LBFGS reads every parameter in its line "
          "search), so it cannot be stepped bucket by bucket: step it after backward instead");
    optimizers_.push_back(std::move(opt));
  }
}

void OverlappedOptimizer::step_bucket(const at::Tensor& flat) {
  BucketStep entry;
  entry.start_ns = now_ns();
  // A bucket's parameters are those whose gradient slot lies in its slice of the flat buffer: BucketedDDP made
  // every .grad() share that memory (stage 02's layout), so an address range identifies them without any index.
  // BEGIN SOLUTION(03): step the parameters whose gradients lie in `flat` and note them in the entry
  const auto* begin = static_cast<const char*>(flat.data_ptr());
  const auto* end = begin + flat.numel() * static_cast<int64_t>(flat.element_size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (!g.defined() || g.numel() == 0) continue;
    const auto* at = static_cast<const char*>(g.data_ptr());
    if (at < begin || at >= end) continue;
    optimizers_[i]->step();
    entry.params.push_back(i);
  }
  // END SOLUTION
  if (entry.params.empty() && flat.numel() > 0)
    throw std::invalid_argument("OverlappedOptimizer::step_bucket: no parameter's gradient lies in the given " +
                                std::to_string(flat.numel()) +
                                "-element bucket; expected a slice of the gradient buffer of these parameters");
  entry.end_ns = now_ns();
  if (recorder_) recorder_->record_busy(entry.start_ns, entry.end_ns);
  log_.push_back(std::move(entry));
}

void OverlappedOptimizer::zero_grad() {
  for (const auto& p : params_)
    if (p.grad().defined()) p.grad().zero_();
}

bucketed_ddp::BucketReducer hook_then_optimizer(bucketed_ddp::BucketReducer reduce,
                                                std::shared_ptr<OverlappedOptimizer> optimizer) {
  if (!optimizer) throw std::invalid_argument("hook_then_optimizer: expected an optimizer; got a null pointer");
  return [reduce = std::move(reduce), optimizer = std::move(optimizer)](Communicator& comm,
                                                                        const at::Tensor& bucket) -> Handle {
    // The reduction starts now, on the backward thread; the step must wait until the average has landed, and must
    // not block that thread: it belongs in the handle's continuation, which runs inside wait() at the end of
    // backward, bucket after bucket in launch order.
    optimizer->report_to(comm.recorder());  // its steps are work inside the end-of-backward wait, not waiting
    // The step, for the handle's continuation. Only a backward that completes steps: after one that failed (a
    // missing gradient) or was cut short, the same waits run in loss() or the destructor, and nothing may change.
    std::function<void()> step = [optimizer, bucket] {
      if (bucketed_ddp::settling_a_complete_backward()) optimizer->step_bucket(bucket);
    };
    // Without a `reduce`, the bucket's plain average (as BucketedDDP does).
    // BEGIN SOLUTION(03): start the bucket's reduction; run `step` once it has landed
    Handle handle = reduce ? reduce(comm, bucket) : comm.all_reduce(bucket, ReduceOp::kAvg);
    return std::move(handle).then(std::move(step));
    // END SOLUTION
  };
}

}  // namespace shardlab::comm_hooks
