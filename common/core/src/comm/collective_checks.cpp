// Checked collectives: the checks every collective makes on the calling thread before anything is sent, so that a
// mistake is a C++ exception with a clear message rather than a failure on Gloo's thread. check_tensor is what one
// rank can see alone (defined, dense, contiguous, a device and dtype the backend takes); check_same_call, when
// set_check_collectives is on, compares the call with every other rank's first (Note [Checked collectives]).

#include "shardlab/core/comm/communicator.h"

#include "detail/collective_common.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceType.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab {

void Communicator::check_tensor(const at::Tensor& t, const char* what, const char* op) const {
  auto fail = [&](const std::string& msg) {
    std::ostringstream s;
    s << op << " on group '" << name_ << "' (rank " << rank_ << "): " << what << ' ' << msg;
    throw std::invalid_argument(s.str());
  };
  if (!t.defined()) fail("is undefined; expected a tensor");
  if (t.layout() != c10::kStrided) fail("must be a dense (strided) tensor");
  if (!t.is_contiguous())
    fail("must be contiguous; got sizes " + c10::str(t.sizes()) + " strides " + c10::str(t.strides()));
  if (kind_ == BackendKind::kNccl && !t.is_cuda()) fail("must be a CUDA tensor for NCCL; got " + t.device().str());
  if (kind_ == BackendKind::kGloo && !(t.is_cpu() || t.is_cuda()))
    fail("must be on CPU or CUDA for Gloo; got " + t.device().str());
  const auto dt = t.scalar_type();
  if (kind_ == BackendKind::kGloo && !detail::gloo_supports(dt) && dt != c10::kBFloat16)
    fail(std::string("has dtype ") + c10::toString(dt) +
         "; expected one of float, double, half, bfloat16, long, int, char, byte");
}

// Note [Checked collectives]
// Gloo pairs the k-th collective of every rank; when their sizes differ, the receiving side finds more bytes than
// it posted, on Gloo's transport thread, and the process ends (gloo::EnforceNotMet, "op.preamble.length <=
// op.nbytes"). PyTorch 1.13 ends the same way; its TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the group so that every
// collective first all-gathers a fingerprint of the call and compares. The check here is that: the call's
// operation, dtypes, element counts, reduction or root, device types and the path it will take (the ring or not),
// as int64s of a fixed count, all-gathered through the backend and waited for on the calling thread, right after the
// tensors' own checks and before the checks one rank can make alone (so a size only one rank got wrong is reported by
// every rank, as the difference it is). A fixed-size gather cannot itself mismatch, and a rank that never comes is the
// group's timeout (on NCCL, the backend's own). Every rank compares every rank's fingerprint with rank 0's, so
// every rank throws the same error, at the call, before anything of the real call is sent.
// What it compares is every call in the order each rank makes it, of every kind: as strict as NCCL, which orders
// everything, and stricter than Gloo's rings, which pair all-gathers and reduce-scatters apart (Note [Ring
// all-gather]). So FSDP with a parameter unused on some ranks only is reported (Note [A parameter unused on some
// ranks]): exact on Gloo with CPU tensors, a mismatch on NCCL. What it costs: one small collective per call, which
// also makes each call wait until every rank has reached it (a rank can no longer run ahead of the others). Hence
// off by default, for finding a bug, as in PyTorch.
namespace {

enum CallField : int64_t {
  kOpField,
  kDtypeField,
  kNumelField,
  kOutputField,
  kOutputDtypeField,
  kDetailField,  // the reduction, or the broadcast's root
  kDeviceField,  // 16 x the input's device type + the output's (Gloo takes CPU and CUDA tensors by different paths)
  kPathField,    // how the call travels: 0 the backend's own, 1 the ring, 2 an all-reduce (reduce-scatter)
  kCallFields
};

std::string describe_call(const int64_t* f) {
  static const char* const ops[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"};
  std::ostringstream s;
  const int64_t op = f[kOpField];
  s << (op >= 0 && op < 5 ? ops[op] : "an unknown collective");
  if (op == 4) return s.str();
  s << " of " << f[kNumelField] << ' ' << c10::toString(static_cast<c10::ScalarType>(f[kDtypeField])) << " elements";
  if (op == 2 || op == 3) s << " (output " << f[kOutputField] << ")";
  if (op == 1) s << " from root " << f[kDetailField];
  if (op == 0 || op == 3) s << " (" << detail::reduce_name(static_cast<ReduceOp>(f[kDetailField])) << ")";
  s << " on " << c10::DeviceTypeName(static_cast<c10::DeviceType>(f[kDeviceField] / 16), /*lower_case=*/true);
  if (op == 2 || op == 3) {
    static const char* const paths[] = {"by the backend", "by the ring", "as an all-reduce"};
    s << ", output " << c10::toString(static_cast<c10::ScalarType>(f[kOutputDtypeField])) << " on "
      << c10::DeviceTypeName(static_cast<c10::DeviceType>(f[kDeviceField] % 16), /*lower_case=*/true);
    if (f[kPathField] >= 0 && f[kPathField] < 3) s << ", " << paths[f[kPathField]];
  }
  return s.str();
}

}  // namespace

void Communicator::check_same_call(const char* op, const at::Tensor& t, const at::Tensor& output, int64_t detail) {
  if (!check_collectives_) return;
  static const std::map<std::string, int64_t> codes{
      {"all_reduce", 0}, {"broadcast", 1}, {"all_gather", 2}, {"reduce_scatter", 3}, {"barrier", 4}};
  at::Tensor mine = at::empty({kCallFields}, at::kLong);
  int64_t* f = mine.data_ptr<int64_t>();
  f[kOpField] = codes.at(op);
  f[kDtypeField] = static_cast<int64_t>(t.scalar_type());
  f[kNumelField] = t.numel();
  f[kOutputField] = output.numel();
  f[kOutputDtypeField] = static_cast<int64_t>(output.scalar_type());
  f[kDetailField] = detail;
  f[kDeviceField] = 16 * static_cast<int64_t>(t.device().type()) + static_cast<int64_t>(output.device().type());
  // The path the call will take, not the setting: kAuto and kRing both take the ring for CPU tensors on Gloo.
  f[kPathField] = f[kOpField] == 2 ? (all_gather_uses_ring(t) ? 1 : 0) : f[kOpField] == 3 ? reduce_scatter_path(t) : 0;
  // NCCL carries CUDA tensors only: the call's device, or the current one for a barrier (whose tensor is empty).
  const c10::Device device = kind_ != BackendKind::kNccl ? c10::Device(c10::kCPU)
                             : t.is_cuda()               ? t.device()
                                                         : c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
  at::Tensor wire = mine.to(device);
  at::Tensor all = at::empty({size_, kCallFields}, wire.options());
  std::vector<at::Tensor> rows;
  rows.reserve(size_);
  for (int r = 0; r < size_; ++r) rows.push_back(all[r]);
  std::vector<std::vector<at::Tensor>> outputs{rows};
  std::vector<at::Tensor> inputs{wire};
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  auto work = issue([&] { return backend_->allgather(outputs, inputs, opts); });
  Handle(std::move(work), nullptr,
         std::string("the check of ") + op + " on group '" + name_ + "' (rank " + std::to_string(rank_) + " of " +
             std::to_string(size_) + ")",
         timeout_)
      .wait();
  const at::Tensor got = all.cpu();
  const int64_t* g = got.data_ptr<int64_t>();
  for (int r = 1; r < size_; ++r) {
    if (std::equal(g, g + kCallFields, g + r * kCallFields)) continue;
    throw std::invalid_argument("collectives differ on group '" + name_ + "': rank 0 calls " + describe_call(g) +
                                ", rank " + std::to_string(r) + " calls " + describe_call(g + r * kCallFields) +
                                ". Every rank must issue the same collectives, of the same sizes, in the same "
                                "order (found by set_check_collectives)");
  }
}

}  // namespace shardlab
