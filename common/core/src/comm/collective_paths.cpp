// Collective paths: which way each collective travels on this group's backend (natively or as a fallback, the
// backend's all-gather or the ring, the backend's reduce-scatter, the ring or an all-reduce) and what that way holds
// in private memory while it is in flight (the *_scratch_bytes a memory meter adds). The collectives and the
// argument checks ask these questions; the answers follow Note [Fallbacks] and the ring Notes.

#include "shardlab/core/comm/communicator.h"

#include "detail/collective_common.h"
#include "shardlab/core/compat.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace shardlab {
namespace detail {

bool gloo_supports(c10::ScalarType t) {
  if (t == c10::kBFloat16) return compat::gloo_features().bfloat16;
  switch (t) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kLong:
    case c10::kInt:
    case c10::kChar:
    case c10::kByte:
      return true;
    default:
      return false;
  }
}

}  // namespace detail

bool Communicator::reduces_natively(c10::ScalarType dtype) const {
  return kind_ == BackendKind::kNccl || detail::gloo_supports(dtype);
}

bool Communicator::has_flat_all_gather(const at::Tensor& t) const {
  return kind_ == BackendKind::kNccl || (compat::gloo_features().flat_all_gather && t.is_cpu());
}

namespace {
bool gather_by_ring(BackendKind kind, AllGatherAlgorithm algorithm, bool cpu) {
  return kind == BackendKind::kGloo && cpu && algorithm != AllGatherAlgorithm::kBackend;
}
}  // namespace

bool Communicator::all_gather_uses_ring(const at::Tensor& t) const {
  return gather_by_ring(kind_, ag_algorithm_, t.is_cpu());
}

bool Communicator::has_reduce_scatter() const { return kind_ == BackendKind::kNccl; }

int Communicator::reduce_scatter_path(const at::Tensor& input) const {
  if (has_reduce_scatter()) return 0;  // NCCL's own
  const int64_t bytes = static_cast<int64_t>(input.numel() * input.element_size());
  const bool ring = rs_algorithm_ == ReduceScatterAlgorithm::kRing ||
                    (rs_algorithm_ == ReduceScatterAlgorithm::kAuto && ring_reduce_scatter_pays(size_, bytes));
  return input.is_cpu() && ring ? 1 : 2;
}

// Note [What the Communicator allocates]
// Beside the caller's tensors, a collective may need private ones while it is in flight; a memory meter that
// leaves them out reports less than the step holds. all_gather_scratch_bytes, reduce_scatter_scratch_bytes and
// all_reduce_scratch_bytes state them by the same rules the collectives follow (collectives.cpp and
// ring_collectives.cpp; they are tested against a counting CPU allocator):
//  - a dtype the backend cannot carry (bf16 on Gloo 1.13) goes as f32 copies of input and output;
//  - Gloo's own all-gather (AllGatherAlgorithm::kBackend, or CUDA tensors) gathers into a flat tensor of its own,
//    then copies it out; its flat all-gather (libtorch 2.x) is the list one inside, with the same copy. The ring
//    all-gather and NCCL write straight into the output;
//  - reduce_scatter on Gloo works on a copy of the whole input (the ring reduces into it; the fallback all-reduces
//    it), and the ring receives into one more row.
// Not counted: what a backend holds inside (Gloo's staging for its ring all-reduce and all-gather algorithms)
// and the small tensors of barrier.
int64_t Communicator::all_gather_scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const {
  const bool f32 = !reduces_natively(dtype);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(f32 ? c10::kFloat : dtype));
  int64_t bytes = f32 ? (size_ + 1) * input_numel * elem : 0;
  // Gloo's flat all-gather (libtorch 2.x) is its list all-gather inside: the same flat copy of the output.
  if (kind_ == BackendKind::kGloo && !gather_by_ring(kind_, ag_algorithm_, device.is_cpu()))
    bytes += size_ * input_numel * elem;
  return bytes;
}

int64_t Communicator::all_reduce_scratch_bytes(c10::ScalarType dtype, int64_t numel) const {
  return reduces_natively(dtype) ? 0 : numel * static_cast<int64_t>(c10::elementSize(c10::kFloat));
}

int64_t Communicator::reduce_scatter_scratch_bytes(c10::ScalarType dtype, int64_t input_numel,
                                                   c10::Device device) const {
  if (has_reduce_scatter()) return 0;
  const bool f32 = !reduces_natively(dtype);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(f32 ? c10::kFloat : dtype));
  const int64_t input_bytes = input_numel * static_cast<int64_t>(c10::elementSize(dtype));
  const bool ring = rs_algorithm_ == ReduceScatterAlgorithm::kRing ||
                    (rs_algorithm_ == ReduceScatterAlgorithm::kAuto && ring_reduce_scatter_pays(size_, input_bytes));
  if (device.is_cpu() && ring) return size_ == 1 ? input_numel * elem : (input_numel + input_numel / size_) * elem;
  return input_numel * elem;
}

}  // namespace shardlab
