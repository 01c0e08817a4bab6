#include "shardlab/core/model/grad_clip.h"

#include <ATen/ATen.h>

#include <cmath>
#include <set>
#include <stdexcept>
#include <string>

namespace shardlab {

// Note [A norm over shards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The global p-norm is a sum (or, for p = infinity, a maximum) over elements, so it splits over any partition of the
// elements: every rank sums |g|^p over the elements it holds, one all-reduce (SUM; MAX for infinity) joins the
// partial results, and every rank takes the p-th root of the same number. What must hold is that the partition is
// exact: every element counted once. FSDP's sharded gradients are exactly that (each rank's real rows, the padding
// never a gradient); HSDP's replicas hold the same shards again, so the join runs over the shard group only (else
// the sum would count each element R times); DDP's ranks each hold the whole, averaged gradient, so there is
// nothing to join. The partial sums are taken in float64: the all-reduce then adds N doubles in some order, which
// changes the result by a few ulps of a double, far below the float32 the gradients are in; p = infinity is exact
// over the same gradients (a sharded run's gradients differ from one device's by the reductions' rounding).
// The scale is PyTorch's: max_norm / (total + 1e-6), clamped to at most 1, applied in place to every gradient.

namespace {

void check_p(double p) {
  if (!(p > 0))
    throw std::invalid_argument("clip_grad_norm: expected a norm type p > 0 (2, or infinity for the maximum); got " +
                                std::to_string(p));
}

// The defined gradients of `params`, each once (a parameter listed twice, a tied weight, counts once).
std::vector<at::Tensor> unique_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& param : params)
    if (seen.insert(param.unsafeGetTensorImpl()).second && param.grad().defined()) grads.push_back(param.grad());
  return grads;
}

}  // namespace

double total_grad_norm(const std::vector<at::Tensor>& params, double p, Communicator* comm) {
  check_p(p);
  const bool inf = std::isinf(p);
  // One float64 scalar on the gradients' device, read once at the end (one host sync, as PyTorch's).
  at::Tensor local;
  for (const auto& g : unique_grads(params)) {
    if (g.numel() == 0) continue;
    // This tensor's norm, accumulated in float64 (one float64 copy of it, transient), then its share of the total.
    const at::Tensor norm = at::linalg_vector_norm(g.detach(), p, c10::nullopt, /*keepdim=*/false, at::kDouble);
    const at::Tensor part = inf ? norm : norm.pow(p);
    local = !local.defined() ? part : (inf ? at::maximum(local, part) : local + part);
  }
  if (!local.defined()) {  // no gradient here: a zero on the parameters' device, for the join
    const c10::Device device = params.empty() ? c10::Device(c10::kCPU) : params.front().device();
    local = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  }
  if (comm != nullptr && comm->size() > 1) {
    local = local.reshape({1}).contiguous();
    comm->all_reduce(local, inf ? ReduceOp::kMax : ReduceOp::kSum).wait();
  }
  const double joined = local.item<double>();
  return inf ? joined : std::pow(joined, 1.0 / p);
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double p, Communicator* comm) {
  if (!(max_norm >= 0) || std::isinf(max_norm))
    throw std::invalid_argument("clip_grad_norm: expected a finite max_norm >= 0; got " + std::to_string(max_norm));
  const double total = total_grad_norm(params, p, comm);
  const double coef = max_norm / (total + 1e-6);
  // PyTorch multiplies by min(coef, 1): nothing changes at 1, and a NaN norm (a NaN gradient) makes every gradient
  // NaN, as there. Only the multiplication by exactly 1 is skipped.
  if (!(coef >= 1.0)) {
    at::NoGradGuard no_grad;
    for (const auto& g : unique_grads(params)) g.mul_(coef);
  }
  return total;
}

}  // namespace shardlab
