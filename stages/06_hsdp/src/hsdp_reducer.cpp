#include "shardlab/hsdp/hsdp_reducer.h"

#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/core/errors.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <utility>

// Note [One divide over two groups]
// The mean over N = R · S ranks is sum(g) / N. Summing in two steps (S ranks, then R) changes nothing about that: the
// reduce-scatter leaves sum over the row, the all-reduce adds the rows. So the division is done once, split as in
// stage 03 into a pre-divide of the input by pre = gradient_predivide_factor(N) and a post-divide of the result by
// N / pre, after both collectives. Dividing by S after the reduce-scatter and by R after the all-reduce would also
// give the mean, but with one more rounding (S = 3: 1/3 is not a power of two), fp16's range concerns per group
// instead of for the whole sum, and a reducer that forgets one of the two trains R or S times too fast without any
// error. With R = 1 the factors are stage 04's (N = S) and there is no all-reduce: HSDP on one replica is FSDP, bit
// for bit.

namespace shardlab::hsdp {
namespace {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return std::string(c10::toString(t.scalar_type())) + " tensor of " + std::to_string(t.numel()) + " elements" +
         (t.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace

HsdpReducer::HsdpReducer(Communicator& shard, Communicator& replicate, Wire wire)
    : shard_(shard), replicate_(replicate), wire_(wire) {}

std::string HsdpReducer::name() const {
  return wire_ == Wire::kReduceDtype ? "hsdp" : std::string("hsdp_") + wire_name(wire_);
}

int64_t HsdpReducer::scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const {
  const c10::ScalarType wire = wire_dtype(wire_, dtype);
  const auto elem = static_cast<int64_t>(c10::elementSize(wire));
  const int64_t copies = wire == dtype ? 0 : (input_numel + input_numel / shard_.size()) * elem;
  return copies + shard_.reduce_scatter_scratch_bytes(wire, input_numel, device);
}

int64_t HsdpReducer::second_phase_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device /*device*/) const {
  if (replicate_.size() == 1) return 0;
  const c10::ScalarType wire = wire_dtype(wire_, dtype);
  const int64_t row = input_numel / shard_.size();
  return row * static_cast<int64_t>(c10::elementSize(dtype)) +
         (wire == dtype ? 0 : row * static_cast<int64_t>(c10::elementSize(wire))) +
         replicate_.all_reduce_scratch_bytes(wire, row);
}

int64_t HsdpReducer::deferred_bytes(c10::ScalarType dtype, int64_t output_numel) const {
  return output_numel * static_cast<int64_t>(c10::elementSize(dtype));
}

Handle HsdpReducer::operator()(const at::Tensor& input, const at::Tensor& output) {
  const int S = shard_.size();
  if (!input.defined() || !output.defined() || !input.is_contiguous() || !output.is_contiguous() ||
      !c10::isFloatingType(input.scalar_type()) || input.scalar_type() != output.scalar_type())
    throw std::invalid_argument(
        "HsdpReducer: expected a contiguous floating input and output of one dtype; got input " + describe(input) +
        " and output " + describe(output));
  if (input.numel() != S * output.numel())
    throw std::invalid_argument("HsdpReducer: expected an input of S x output = " + std::to_string(S) + " x " +
                                std::to_string(output.numel()) + " elements (S = the shard group's size); got " +
                                std::to_string(input.numel()));
  // TODO(stage06): the two-phase mean over all N ranks, divided once, the all-reduce never waited for here
  throw ::shardlab::NotImplemented("06", "the two-phase mean over all N ranks, divided once, the all-reduce never waited for here");
}

void HsdpReducer::discard() {
  ++generation_;
  partial_ = at::Tensor();
}

int64_t HsdpReducer::partial_bytes() const {
  return partial_.defined() ? static_cast<int64_t>(partial_.numel() * partial_.element_size()) : 0;
}

void HsdpSwitch::set_requires_all_reduce(bool requires_all_reduce) {
  requires_all_reduce_ = requires_all_reduce;
  for (const auto& weak : reducers_)
    if (auto reducer = weak.lock()) reducer->set_requires_all_reduce(requires_all_reduce);
}

void HsdpSwitch::add(const std::shared_ptr<HsdpReducer>& reducer) {
  SHARDLAB_INTERNAL_ASSERT(reducer != nullptr, "HsdpSwitch::add: a null reducer");
  reducer->set_requires_all_reduce(requires_all_reduce_);
  reducers_.push_back(reducer);
}

size_t HsdpSwitch::size() const {
  size_t alive = 0;
  for (const auto& weak : reducers_) alive += weak.expired() ? 0 : 1;
  return alive;
}

fsdp::ReducerFactory hsdp_reducers(Wire wire, std::shared_ptr<HsdpSwitch> sync) {
  return [wire, sync = std::move(sync)](const fsdp::ReducerRequest& request) -> std::shared_ptr<fsdp::GradientReducer> {
    if (request.mesh.replicate == nullptr)
      throw std::invalid_argument("hsdp_reducers: unit '" + request.unit +
                                  "' is on a mesh without a replicate group (FSDP on one group); build "
                                  "FullyShardedModel on hsdp::mesh_info(mesh)");
    auto reducer = std::make_shared<HsdpReducer>(*request.mesh.shard, *request.mesh.replicate, wire);
    if (sync) sync->add(reducer);
    return reducer;
  };
}

}  // namespace shardlab::hsdp
