#pragma once
// Gradients as the tests reason about them: a rank's own gradient, computed beside a DDP wrapper without it seeing
// anything, the average two ranks' all-reduce leaves, and a backward cut short.
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/model.h"
#include "shardlab/course/data.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <stdexcept>
#include <vector>

namespace shardlab::test_support {

/// The gradient of `model.loss(batch)` with respect to each of `params`, computed without accumulating into any
/// `.grad()` (so no gradient-ready hook fires: a DDP wrapper of `model` sees nothing). Undefined for a parameter
/// the loss does not depend on. Run before a backward through the wrapper, it gives this rank's own gradient of
/// that backward bit for bit (the same operations on the same values).
inline std::vector<at::Tensor> local_gradients(Model& model, const Batch& batch,
                                               const std::vector<at::Tensor>& params) {
  const at::Tensor loss = model.loss(batch);
  return torch::autograd::grad({loss}, params, /*grad_outputs=*/{}, /*retain_graph=*/false,
                               /*create_graph=*/false, /*allow_unused=*/true);
}

/// A copy of each of `params`' gradients (all defined), in order: what a step left, kept past the next zero_grad.
inline std::vector<at::Tensor> grad_copies(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad().clone());
  return out;
}

/// What an average over two ranks leaves, bit for bit: one addition (the same in either order), then a halving
/// (exact). So a 2-rank all-reduce of `a` and `b` with ReduceOp::kAvg must give exactly this.
inline at::Tensor mean_of_two(const at::Tensor& a, const at::Tensor& b) { return (a + b) / 2; }

/// Largest |a - b| (0 for two empty tensors): the difference a failing exact check prints.
inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == 0 ? 0.0 : (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

/// Runs `backward()` with a gradient hook on `param` that throws, so backward stops where it reaches `param`:
/// gradients autograd reached before were accumulated (their ready hooks ran, their collectives launched), the
/// rest not. Removes the hook again. Returns whether `backward()` threw, as it must.
template <typename Backward>
bool backward_cut_short_at(const at::Tensor& param, Backward backward) {
  const unsigned hook = param.register_hook(
      [](const at::Tensor&) -> at::Tensor { throw std::runtime_error("injected failure in backward"); });
  bool threw = false;
  try {
    backward();
  } catch (const std::exception&) {
    threw = true;
  }
  param.remove_hook(hook);
  return threw;
}

/// A backward cut short on one of 2 ranks, and what a test of the forward that settles it compares with.
struct CutShortBackward {
  Batch aborted, next;                            ///< this rank's halves of global batches 0 and 1 (8 examples)
  std::vector<at::Tensor> own_aborted, own_next;  ///< the rank's own gradients of each (local_gradients)
  size_t mark = 0;                                ///< comm.recorder().size() before the cut-short backward
  size_t launched = 0;                            ///< the collectives that backward launched
  bool threw = false;                             ///< whether it threw, as it must
};

/// On one of 2 ranks: the rank's own gradients of its halves of global batches 0 and 1 of `data`, then a backward
/// through `ddp` (a wrapper of `model`) on the first, cut short at `params.front()` (backward_cut_short_at): the
/// first layer's weight, the last gradient backward reaches, so the later layers' gradients were accumulated and
/// their collectives launched.
template <typename Wrapper>
CutShortBackward cut_short_backward(Communicator& comm, Model& model, Wrapper& ddp, const Dataset& data,
                                    const std::vector<at::Tensor>& params) {
  CutShortBackward cut;
  cut.aborted = rank_slice(data.global_batch(0, 8), comm.rank(), 2);
  cut.next = rank_slice(data.global_batch(1, 8), comm.rank(), 2);
  cut.own_aborted = local_gradients(model, cut.aborted, params);
  cut.own_next = local_gradients(model, cut.next, params);
  cut.mark = comm.recorder().size();
  cut.threw = backward_cut_short_at(params.front(), [&] { ddp.loss(cut.aborted).backward(); });
  cut.launched = comm.recorder().size() - cut.mark;
  return cut;
}

}  // namespace shardlab::test_support
