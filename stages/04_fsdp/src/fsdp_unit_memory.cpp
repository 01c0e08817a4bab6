// A unit's memory (fsdp_unit.h): the bytes its buffers should hold (what the theory reads), and what the meter counts
// of its gradients. The unit's state machine (fsdp_unit.cpp) never calls the meter: see Note [Counting a unit's
// memory].
#include "shardlab/fsdp/fsdp_unit.h"

#include "shardlab/core/storage/flat_storage.h"

#include <c10/core/ScalarType.h>

namespace shardlab::fsdp {
namespace {

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0; }

}  // namespace

// Note [Counting a unit's memory]
// The meter counts what the unit's buffers hold, from two sources:
//  - the parameters' buffers are counted where they are allocated: the sharded buffer, the gathered buffer, the
//    all-gather's buffers and what the gather seam packs and unpacks come from the unit's CountingAllocators
//    (memory.h), which count a block when it is allocated and release it when it is freed. The state machine holds
//    no accounting: it frees the gathered buffer (free_storage) and drops the all-gather's buffers and handle, and
//    the blocks are given back, and uncounted, at that moment. What is counted is what the allocator handed out, not
//    a formula: all_gather_bytes() and gathered_capacity_bytes() are the theory's (fsdp_memory.cpp), and a wrong
//    one shows as a measured peak that differs from it. Not counted: the Communicator's private copies (bf16 on
//    Gloo, Gloo's own all-gather: all_gather_comm_bytes(), stated by Note [What the Communicator allocates] and
//    tested against a counting allocator in common/), which the theory reports beside the peak. The count is exact
//    where the last reference to a buffer is the unit's: the ring all-gather (Gloo on CPU, the default) drops its
//    rows before it completes. Where a backend's worker thread holds the work a little past its completion (Gloo's
//    own all-gather: AllGatherAlgorithm::kBackend, or CUDA tensors on Gloo), a buffer may be given back, and
//    uncounted, a moment after the unit drops it.
//  - the gradients are counted as they are now (count(): by the storage each one really has), where they are made or
//    freed: when the wrapper notes an unsharded gradient autograd accumulated, when stash_gradients makes an
//    accumulator (before the gradient it copies is freed: their peak), after a reduction freed them, when it lands
//    (the sharded gradients it made, and those the optimizer dropped), and when a failed backward's are discarded.
//    A reduction's own buffers are counted from its launch, by the phases it frees them in: Note [A reduction's
//    bytes, phase by phase]. (Counting these at their allocation too, autograd's included, is the next step.)
//
// Note [A reduction's bytes, phase by phase]
// A reduction holds its input (S rows), its output (one row) and the reducer's scratch (reduce_bytes()) from its
// launch. A one-phase reducer frees them all when it is waited for. A two-phase one (HSDP) frees its input and the
// first phase's scratch when FSDP advances it (before the next unit's reduction), and keeps only the output and its
// second phase's buffers (GradientReducer::second_phase_bytes) until the end of backward. The meter follows: the
// first part is released by the handle's on_advance step (for a one-phase reducer, whose second part is 0: at its
// wait), the rest at the wait. The reduction's bytes are counted before the gradients it took are released, so the
// peak holds both, as when its buffers were filled. A reducer's own partial (held_bytes(): HSDP's deferred
// micro-batches) is counted while it holds it; a call that takes it in moves it to that call's first part (it is
// summed into the row before the second phase).

int64_t FsdpUnit::gathered_bytes() const { return storage_bytes(gathered_); }

int64_t FsdpUnit::gathered_capacity_bytes() const { return gathered_numel_ * c10::elementSize(dtypes_.param); }

int64_t FsdpUnit::sharded_bytes() const { return bytes_of(sharded_flat_); }

int64_t FsdpUnit::all_gather_bytes_held() const { return storage_bytes(all_gather_out_); }

int64_t FsdpUnit::all_gather_bytes() const {
  const GatherWire wire = gather_->wire(shard_numel_, dtypes_.param);
  return comm_.size() * wire.numel * static_cast<int64_t>(c10::elementSize(wire.dtype)) +
         gather_->pack_bytes(shard_numel_, dtypes_.orig, dtypes_.param);
}

int64_t FsdpUnit::unpack_bytes() const { return gather_->unpack_bytes(shard_numel_, dtypes_.param); }

int64_t FsdpUnit::all_gather_comm_bytes() const {
  const GatherWire wire = gather_->wire(shard_numel_, dtypes_.param);
  return comm_.all_gather_scratch_bytes(wire.dtype, wire.numel, sharded_flat_.device());
}

int64_t FsdpUnit::unsharded_grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& fp : params_)
    if (fp.trainable) bytes += fp.spec.numel() * static_cast<int64_t>(c10::elementSize(dtypes_.param));
  return bytes;
}

int64_t FsdpUnit::reduce_bytes() const {
  if (grad_row_numel_ == 0) return 0;
  const int64_t input = comm_.size() * grad_row_numel_;
  return (input + grad_row_numel_) * static_cast<int64_t>(c10::elementSize(dtypes_.reduce)) +
         reducer_->scratch_bytes(dtypes_.reduce, input, sharded_flat_.device());
}

int64_t FsdpUnit::second_phase_bytes() const {
  if (grad_row_numel_ == 0) return 0;
  return reducer_->second_phase_bytes(dtypes_.reduce, comm_.size() * grad_row_numel_, sharded_flat_.device());
}

int64_t FsdpUnit::deferred_bytes() const {
  return grad_row_numel_ == 0 ? 0 : reducer_->deferred_bytes(dtypes_.reduce, grad_row_numel_);
}

void FsdpUnit::emit(UnitEventKind kind) {
  if (sink_) sink_(kind);
}

void FsdpUnit::count(MemoryKind kind, Counted& counted, const at::Tensor& now) {
  const c10::StorageImpl* storage = now.defined() ? now.storage().unsafeGetStorageImpl() : nullptr;
  if (storage == counted.storage) return;  // the same tensor's memory (autograd adds in place): counted already
  if (counted.bytes > 0) meter_.release(kind, counted.bytes);
  counted = {storage, bytes_of(now)};
  if (counted.bytes > 0) meter_.allocate(kind, counted.bytes);
}

void FsdpUnit::note_gradient(size_t k) {
  count(MemoryKind::kGrads, counted_unsharded_.at(k), params_.at(k).param.grad());
}

void FsdpUnit::count_gradient(size_t k) {
  count(MemoryKind::kGrads, counted_accumulated_[k], accumulated_[k]);  // first: a new one beside what it copied
  count(MemoryKind::kGrads, counted_unsharded_[k], params_[k].param.grad());
}

void FsdpUnit::count_unsharded_gradients() {
  for (size_t k = 0; k < params_.size(); ++k) count_gradient(k);
}

void FsdpUnit::count_sharded_gradients() {
  // The optimizer may have dropped a sharded gradient (libtorch 2.x zero_grad sets them to None) and the reduction
  // made a new one: each is counted by the storage it really has.
  for (size_t k = 0; k < params_.size(); ++k) count(MemoryKind::kGrads, counted_sharded_[k], params_[k].sharded.grad());
}

void FsdpUnit::count_reducer_bytes() {
  const int64_t now = reducer_->held_bytes();
  if (now > reducer_bytes_) meter_.allocate(MemoryKind::kGrads, now - reducer_bytes_);
  if (now < reducer_bytes_) meter_.release(MemoryKind::kGrads, reducer_bytes_ - now);
  reducer_bytes_ = now;
}

FsdpUnit::ReductionBytes FsdpUnit::count_reduction() {
  const int64_t transient = reduce_bytes();  // with the reducer's copies
  meter_.allocate(MemoryKind::kGrads, transient);
  count_unsharded_gradients();  // the reduction freed them
  ReductionBytes out{transient - second_phase_bytes(), second_phase_bytes()};
  const int64_t kept = reducer_->held_bytes();
  if (kept < reducer_bytes_) out.first += reducer_bytes_ - kept;  // the partial it took goes with the first phase
  if (kept > reducer_bytes_) meter_.allocate(MemoryKind::kGrads, kept - reducer_bytes_);
  reducer_bytes_ = kept;
  return out;
}

void FsdpUnit::count_reduction_done(int64_t bytes) {
  if (bytes > 0) meter_.release(MemoryKind::kGrads, bytes);
}

}  // namespace shardlab::fsdp
