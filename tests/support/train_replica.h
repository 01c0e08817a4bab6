#pragma once
// The training loop every stage's equivalence tests share: K steps of one rank's replica through a DDP wrapper,
// on this rank's slice of each global batch, split into micro-batches of which all but the last run inside
// no_sync(), exactly as `train_reference` does on one device with the whole batch.
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include <vector>

namespace shardlab::test_support {

/// Trains through `ddp` (any wrapper with `loss(Batch)` and `no_sync()`) for `c.steps` steps, the optimizer
/// stepping `params` (a replica's parameters, or FSDP's shards), with the batches on `device`, clipping through
/// `ddp.clip_grad_norm` before each step when `c.clip_norm` > 0. `after_step(step)`, when given, runs after each
/// optimizer step.
template <typename Wrapper, typename AfterStep = void (*)(int)>
void train_steps(
    Communicator& comm, const TrainConfig& c, std::vector<at::Tensor> params, const c10::Device& device, Wrapper& ddp,
    AfterStep after_step = [](int) {}) {
  auto data = make_dataset(c.model, c.seed);
  auto opt = make_optimizer(c.optimizer, std::move(params), c.lr);
  for (int step = 0; step < c.steps; ++step) {
    compat::zero_grad(*opt);
    auto micro = micro_batches(
        rank_slice(data->global_batch(step, c.global_batch), comm.rank(), comm.size()).to(device), c.micro_batches);
    for (int i = 0; i < c.micro_batches; ++i) {
      if (i + 1 < c.micro_batches) {
        auto scope = ddp.no_sync();
        (ddp.loss(micro[i]) / c.micro_batches).backward();
      } else {
        (ddp.loss(micro[i]) / c.micro_batches).backward();
      }
    }
    if (c.clip_norm > 0) ddp.clip_grad_norm(c.clip_norm, c.clip_p);
    opt->step();
    after_step(step);
  }
}

/// Detached float32 copies of `ts` on CPU, their own memory (what tests compare across ranks and with the reference).
inline std::vector<at::Tensor> on_cpu(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().cpu().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  return out;
}

/// Trains `model` through `ddp` (see train_steps) for `c.steps` steps, with the batches on the model's device, and
/// returns every parameter of the model (registration order), detached copies on CPU.
template <typename Wrapper>
std::vector<at::Tensor> train_replica(Communicator& comm, const TrainConfig& c, Model& model, Wrapper& ddp) {
  train_steps(comm, c, trainable_parameters(model), model.parameters().front().device(), ddp);
  std::vector<at::Tensor> out;
  for (const auto& p : model.parameters()) out.push_back(p.detach().cpu().clone());
  return out;
}

}  // namespace shardlab::test_support
