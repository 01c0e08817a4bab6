#pragma once
// Gradients as the tests reason about them: a rank's own gradient, computed beside a DDP wrapper without it seeing
// anything, and the average two ranks' all-reduce leaves.
#include "shardlab/core/model/model.h"

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

}  // namespace shardlab::test_support
