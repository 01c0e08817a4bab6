// Collectives: the public calls (all_reduce, broadcast, all_gather, reduce_scatter, barrier). Each checks its
// arguments (collective_checks.cpp), picks its path (collective_paths.cpp), falls back where the backend lacks an
// operation or dtype (Note [Fallbacks]), records what goes on the wire and issues it (dispatch.cpp); the ring paths
// are in ring_collectives.cpp.

#include "shardlab/core/comm/communicator.h"

#include "detail/collective_common.h"
#include "shardlab/core/errors.h"

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// Note [Fallbacks]
// Gloo 1.13 has no ReduceOp::AVG, no bfloat16, no flat (tensor-in, tensor-out) all-gather and no reduce-scatter.
// Gloo 2.6 has bfloat16 and the flat all-gather (compat::gloo_features() says which, for this build); its
// `_reduce_scatter_base` is an all-reduce of the whole input inside, and checks shapes with an abort, so the
// fallback below is used instead, and says honestly what went on the wire. Where the backend lacks something,
// the Communicator keeps one API over every backend and falls back like this:
//  - AVG           → SUM on the wire, then the waiting thread divides by size() (floating dtypes only).
//  - bfloat16      → the tensor is cast to float32 (exact), communicated, and cast back on wait(); the record shows
//                    wire_dtype float32 and twice the bytes.
//  - all_gather    → the ring of send/recv (CPU tensors, Note [Ring all-gather]), or Gloo's own all-gather into
//                    views of the flat output (CUDA tensors, AllGatherAlgorithm::kBackend).
//  - reduce_scatter→ all-reduce of a copy of the whole input, then the waiting thread copies this rank's chunk out;
//                    the record shows wire_op all_reduce and the bytes of the whole input.
// Everything is validated on the calling thread first: an error raised on Gloo's worker thread can terminate the
// process instead of reaching wait().

namespace shardlab {
namespace {

bool is_floating(c10::ScalarType t) { return c10::isFloatingType(t); }

}  // namespace

namespace detail {

// Tier 3 of Note [Three error tiers]: legal, but more bytes than the user may think.
void warn_bf16_sent_as_f32(const char* op) {
  warn_once("bf16 sent as f32", std::string(op) +
                                    ": this Gloo has no bf16, so bf16 tensors travel as f32 "
                                    "(twice the bytes) and are rounded back on arrival; see Note [Fallbacks]");
}

}  // namespace detail

Handle Communicator::all_reduce(const at::Tensor& t, ReduceOp op) {
  check_tensor(t, "tensor", "all_reduce");
  check_same_call("all_reduce", t, t, static_cast<int64_t>(op));
  const bool bf16_fallback = !reduces_natively(t.scalar_type());
  const bool native_avg = kind_ == BackendKind::kNccl;
  if (op == ReduceOp::kAvg && !is_floating(t.scalar_type()))
    throw std::invalid_argument(std::string("all_reduce: avg needs a floating dtype; got ") +
                                c10::toString(t.scalar_type()));
  if (bf16_fallback) detail::warn_bf16_sent_as_f32("all_reduce");
  at::Tensor wire = bf16_fallback ? t.to(c10::kFloat) : t;
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::kMax                   ? c10d::ReduceOp::MAX
                  : (op == ReduceOp::kAvg && native_avg) ? c10d::ReduceOp::AVG
                                                         : c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  const size_t idx = record("all_reduce", "all_reduce", t, wire, &op);
  std::vector<at::Tensor> tensors{wire};
  auto work = issue([&] { return backend_->allreduce(tensors, opts); });
  const bool divide = op == ReduceOp::kAvg && !native_avg;
  std::function<void()> finish;
  if (divide || bf16_fallback) {
    finish = [t, wire, divide, n = size_] {
      if (divide) wire.div_(n);
      if (!wire.is_same(t)) t.copy_(wire);
    };
  }
  return submit(std::move(work), idx, std::move(finish), "all_reduce", t.is_cpu());
}

Handle Communicator::broadcast(const at::Tensor& t, int root) {
  check_tensor(t, "tensor", "broadcast");
  check_same_call("broadcast", t, t, root);
  if (root < 0 || root >= size_)
    throw std::invalid_argument("broadcast: root must be in [0, " + std::to_string(size_) + "); got " +
                                std::to_string(root));
  const bool bf16_fallback = !reduces_natively(t.scalar_type());
  if (bf16_fallback) detail::warn_bf16_sent_as_f32("broadcast");
  at::Tensor wire = bf16_fallback ? t.to(c10::kFloat) : t;
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = timeout_;
  const size_t idx = record("broadcast", "broadcast", t, wire, nullptr);
  std::vector<at::Tensor> tensors{wire};
  auto work = issue([&] { return backend_->broadcast(tensors, opts); });
  std::function<void()> finish;
  if (bf16_fallback) finish = [t, wire] { t.copy_(wire); };
  return submit(std::move(work), idx, std::move(finish), "broadcast", t.is_cpu());
}

Handle Communicator::all_gather(const at::Tensor& output, const at::Tensor& input) {
  check_tensor(output, "output", "all_gather");
  check_tensor(input, "input", "all_gather");
  check_same_call("all_gather", input, output, 0);
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device())
    throw std::invalid_argument(std::string("all_gather: output and input must share dtype and device; got ") +
                                c10::toString(output.scalar_type()) + "/" + output.device().str() + " and " +
                                c10::toString(input.scalar_type()) + "/" + input.device().str());
  if (output.numel() != size_ * input.numel())
    throw std::invalid_argument(
        "all_gather: output must have world_size * input.numel() = " + std::to_string(size_ * input.numel()) +
        " elements; got " + std::to_string(output.numel()));
  const bool bf16_fallback = !reduces_natively(input.scalar_type());
  if (bf16_fallback) detail::warn_bf16_sent_as_f32("all_gather");
  at::Tensor wire_in = bf16_fallback ? input.to(c10::kFloat) : input;
  at::Tensor wire_out =
      bf16_fallback ? at::empty({output.numel()}, output.options().dtype(c10::kFloat)) : output.view({-1});
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  std::function<void()> finish;
  if (bf16_fallback) finish = [output, wire_out] { output.view({-1}).copy_(wire_out); };
  if (all_gather_uses_ring(input)) return ring_all_gather(output, wire_out, wire_in.contiguous(), input);
  if (has_flat_all_gather(input)) {
    at::Tensor in = wire_in.contiguous().view({-1});  // the backend splits the output into pieces shaped like this
    const size_t idx = record("all_gather", "all_gather", input, in, nullptr);
    auto work = issue([&] { return backend_->_allgather_base(wire_out, in, opts); });
    return submit(std::move(work), idx, std::move(finish), "all_gather", input.is_cpu());
  }
  std::vector<at::Tensor> chunks;
  chunks.reserve(size_);
  at::Tensor rows = wire_out.view({size_, -1});
  for (int r = 0; r < size_; ++r) chunks.push_back(rows[r].view(wire_in.sizes()));
  std::vector<std::vector<at::Tensor>> outputs{chunks};
  std::vector<at::Tensor> inputs{wire_in.contiguous()};
  const size_t idx = record("all_gather", "all_gather(list)", input, wire_in, nullptr);
  auto work = issue([&] { return backend_->allgather(outputs, inputs, opts); });
  return submit(std::move(work), idx, std::move(finish), "all_gather", input.is_cpu());
}

Handle Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  check_tensor(output, "output", "reduce_scatter");
  check_tensor(input, "input", "reduce_scatter");
  check_same_call("reduce_scatter", input, output, static_cast<int64_t>(op));
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device())
    throw std::invalid_argument(std::string("reduce_scatter: output and input must share dtype and device; got ") +
                                c10::toString(output.scalar_type()) + "/" + output.device().str() + " and " +
                                c10::toString(input.scalar_type()) + "/" + input.device().str());
  if (input.numel() != size_ * output.numel())
    throw std::invalid_argument(
        "reduce_scatter: input must have world_size * output.numel() = " + std::to_string(size_ * output.numel()) +
        " elements; got " + std::to_string(input.numel()));
  if (op == ReduceOp::kMax)
    throw std::invalid_argument("reduce_scatter: expected ReduceOp::kSum or kAvg; got kMax (all_reduce only)");
  if (op == ReduceOp::kAvg && !is_floating(input.scalar_type()))
    throw std::invalid_argument(std::string("reduce_scatter: avg needs a floating dtype; got ") +
                                c10::toString(input.scalar_type()));
  if (has_reduce_scatter()) {  // NCCL: reduces (AVG included) and scatters by itself
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = op == ReduceOp::kAvg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    opts.timeout = timeout_;
    at::Tensor in = input.view({-1}), out = output.view({-1});
    const size_t idx = record("reduce_scatter", "reduce_scatter", input, in, &op);
    auto work = issue([&] { return backend_->_reduce_scatter_base(out, in, opts); });
    return submit(std::move(work), idx, nullptr, "reduce_scatter", input.is_cpu());
  }
  const int64_t bytes = static_cast<int64_t>(input.numel() * input.element_size());
  const bool ring_pays = ring_reduce_scatter_pays(size_, bytes);
  if (reduce_scatter_path(input) == 1) return ring_reduce_scatter(output, input, op);
  if (ring_pays)
    warn_once(
        "reduce_scatter sent as all_reduce",
        "reduce_scatter of " + std::to_string(bytes) + " bytes at " + std::to_string(size_) +
            " ranks sent as an all-reduce of the whole input (" +
            (input.is_cpu() ? std::string("ReduceScatterAlgorithm::kAllReduce was chosen")
                            : "the ring runs on CPU tensors only") +
            "): each rank receives the whole reduced input, world size times what it keeps; see Note [Fallbacks]");
  const bool bf16_fallback = !reduces_natively(input.scalar_type());
  if (bf16_fallback) detail::warn_bf16_sent_as_f32("reduce_scatter");
  // See Note [Fallbacks]: all-reduce a private copy of the whole input, keep this rank's chunk.
  at::Tensor wire = bf16_fallback ? input.to(c10::kFloat) : input.clone();
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = timeout_;
  const size_t idx = record("reduce_scatter", "all_reduce", input, wire, &op);
  std::vector<at::Tensor> tensors{wire};
  auto work = issue([&] { return backend_->allreduce(tensors, opts); });
  auto finish = [output, wire, op, r = rank_, n = size_] {
    at::Tensor mine = wire.view({n, -1})[r];
    if (op == ReduceOp::kAvg) mine.div_(n);
    output.view({-1}).copy_(mine);
  };
  return submit(std::move(work), idx, std::move(finish), "reduce_scatter", input.is_cpu());
}

void Communicator::barrier() {
  c10d::BarrierOptions opts;
  opts.timeout = timeout_;
  at::Tensor none = at::empty({0});
  check_same_call("barrier", none, none, 0);
  const size_t idx = record("barrier", "barrier", none, none, nullptr);
  submit(issue([&] { return backend_->barrier(opts); }), idx, nullptr, "barrier", kind_ == BackendKind::kGloo).wait();
}

}  // namespace shardlab
