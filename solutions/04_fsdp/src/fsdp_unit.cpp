#include "shardlab/fsdp/fsdp_unit.h"

#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/storage/flat_storage.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/CPUAllocator.h>

#include <stdexcept>

// Note [Two buffers per unit]
// A unit's parameters live in two flat buffers, never in tensors of their own:
//  - the sharded buffer (original dtype): this rank's padded shard of each parameter, back to back. The all-gather
//    sends it as it is (or cast to the param dtype), so no copy-in is needed; the sharded parameters the optimizer
//    steps are slots of it (the real rows only: the padding never reaches an optimizer).
//  - the gathered buffer (param dtype): each full parameter, back to back. The module's registered tensors are
//    slots of it, set once at construction (`set_data`), so the module computes with them unchanged. Between uses
//    the buffer has 0 bytes.
// The all-gather output is rank-major (block r = rank r's shards), but a full parameter needs its rows from every
// block: one all-gather per unit means one copy-out (FSDP2's split_with_sizes_copy). For the moment of the copy
// both the all-gather buffer and the gathered buffer exist: the unit's peak is about twice its gathered size, and
// MemoryTheory counts both. The gathered buffer gets its bytes only then, at copy-out (as FSDP2 allocates its
// unsharded parameters at copy-out), so a unit whose all-gather is in flight early (stage 05's prefetch) holds its
// all-gather buffer only.
//
// Note [Copy-out, in place, or zero-copy]
// Three ways from the rank-major all-gather output to full parameters, weighed for this course:
//  - copy-out into a second buffer (here, and FSDP2): both buffers exist while the copy runs, one unit more at that
//    moment. Each rank's shard is each parameter's own dim-0 rows, which the optimizer, clipping and checkpoints
//    address per parameter.
//  - an in-place permutation of the all-gather buffer into parameter-major order (the registered tensors slots of
//    it): the transpose of an N x P matrix of blocks whose width differs per parameter, done by following its
//    cycles. It saves the second buffer, but only where nothing is prefetched. With prefetch depth k >= 1 the
//    schedule issues the next unit's all-gather after this unit's copy-out, so the copy-out's moment (gathered,
//    own buffer, k-1 ahead) and the moment after it (gathered, k ahead) both hold 1 + k units: what an in-place
//    unit holds with k ahead. Stage 05's default costs nothing for the copy; only stage 04 alone (depth 0) does.
//  - zero-copy (Megatron-FSDP; FSDP1's flat parameter): shard each unit's parameter-major buffer evenly, so that
//    each rank's shard is a contiguous slice of it and the all-gather output is the gathered buffer: no copy, no
//    second buffer. The price: a shard cuts parameters at arbitrary elements, so the optimizer steps fragments,
//    and everything per parameter (a norm for clipping, optimizer state by shape, a checkpoint resharded to another
//    world size, a user's look at sharded_parameters()) must reassemble them. FSDP2 left FSDP1's flat parameter for
//    that reason, and stages 06 and later build on per-parameter shards.
// So the copy-out stays. What did cost memory was hidden: Gloo's all-gather filled a flat copy of the output of its
// own, one more unit at every all-gather; the Communicator's ring all-gather writes straight into the buffer (Note
// [Ring all-gather]), and CommunicatorScratch (tests/common/test_memory.cpp) fails if such a copy comes back.
//
// Note [Why the registered tensor never changes]
// Autograd saves the registered tensor (a Linear saves its weight) in the forward and checks its version counter
// in the backward. Writing the gathered values *through the gathered buffer* leaves the registered tensor's own
// counter alone (it is a slot made with set_, not a view), so a unit freed after its forward and gathered again
// before its backward passes that check. See Note [Freeing storage that autograd saved] in common.

namespace shardlab::fsdp {
namespace {

std::string describe(const at::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " " + c10::str(t.sizes()) + " on " + t.device().str();
}

}  // namespace

const char* to_string(UnitEventKind kind) {
  switch (kind) {
    case UnitEventKind::kBeginUnshard:
      return "begin_unshard";
    case UnitEventKind::kFinishUnshard:
      return "finish_unshard";
    case UnitEventKind::kReshard:
      return "reshard";
    case UnitEventKind::kReduceLaunched:
      return "reduce_launched";
    case UnitEventKind::kReduceLanded:
      return "reduce_landed";
  }
  return "?";
}

const char* to_string(UnitState state) {
  switch (state) {
    case UnitState::kSharded:
      return "sharded";
    case UnitState::kUnsharding:
      return "unsharding";
    case UnitState::kUnsharded:
      return "unsharded";
  }
  return "?";
}

FsdpUnit::FsdpUnit(std::string name, const std::vector<std::pair<std::string, at::Tensor>>& params, Communicator& comm,
                   const MixedPrecision& policy, std::shared_ptr<GradientReducer> reducer, MemoryMeter& meter,
                   BufferPool* pool, std::shared_ptr<const GatherSeam> gather)
    : name_(std::move(name)),
      comm_(comm),
      reducer_(std::move(reducer)),
      meter_(meter),
      pool_(pool),
      gather_(gather ? std::move(gather) : cast_gather()) {
  validate(name_, params);
  if (!reducer_) throw std::invalid_argument("FsdpUnit '" + name_ + "': expected a gradient reducer; got null");
  const at::Tensor& first = params.front().second;
  dtypes_ = resolve_dtypes(policy, first.scalar_type());
  const int world = comm_.size(), rank = comm_.rank();
  for (const auto& [pname, p] : params) {
    FsdpParam fp;
    fp.name = pname;
    fp.param = p;
    fp.spec = shard_spec(p.sizes(), world);
    fp.trainable = p.requires_grad();
    fp.shard_offset = shard_numel_;
    fp.gathered_offset = gathered_numel_;
    shard_numel_ += fp.spec.padded_numel();
    gathered_numel_ += fp.spec.numel();
    if (fp.trainable) {
      fp.grad_offset = grad_row_numel_;
      grad_row_numel_ += fp.spec.padded_numel();
    }
    params_.push_back(std::move(fp));
  }
  accumulated_.resize(params_.size());
  counted_unsharded_.resize(params_.size());
  counted_accumulated_.resize(params_.size());
  counted_sharded_.resize(params_.size());

  at::NoGradGuard no_grad;
  // The parameters' buffers are counted where they are allocated (Note [Counting a unit's memory]): the shards from
  // the device's allocator, the rest from the pool on CPU (regrow_storage draws the gathered buffer from it too).
  // The allocator at::empty uses on this device (libtorch registers none for CUDA with c10::SetAllocator).
  device_allocator_ = at::empty({0}, first.options()).storage().allocator();
  SHARDLAB_INTERNAL_ASSERT(device_allocator_ != nullptr, "FsdpUnit: no allocator for " + first.device().str());
  shards_allocator_ = std::make_unique<CountingAllocator>(device_allocator_, meter_, MemoryKind::kParams);
  buffers_allocator_ = std::make_unique<CountingAllocator>(
      first.is_cpu() && pool_ != nullptr ? pool_ : device_allocator_, meter_, MemoryKind::kParams);
  sharded_flat_ = shards_allocator_->empty(shard_numel_, first.scalar_type(), first.device());
  gathered_ = buffers_allocator_->empty(gathered_numel_, dtypes_.param, first.device());
  // BEGIN SOLUTION(04): copy in this rank's shard of every parameter; make the sharded and the gathered slots
  for (auto& fp : params_) {
    copy_in_shard(fp.spec, fp.param.detach(), rank, sharded_flat_.narrow(0, fp.shard_offset, fp.spec.padded_numel()));
    fp.sharded = alias_slot(sharded_flat_, fp.shard_offset, fp.spec.shard_sizes(rank));
    fp.sharded.requires_grad_(fp.trainable);
    // The registered tensor keeps its identity (the module's and autograd's references stay valid): only its data
    // becomes a slot of the gathered buffer, in the param dtype. See Note [Why the registered tensor never changes].
    fp.param.mutable_grad().reset();
    fp.param.set_data(alias_slot(gathered_, fp.gathered_offset, fp.spec.sizes));
  }
  free_storage(gathered_);
  // END SOLUTION
}

void FsdpUnit::validate(const std::string& name, const std::vector<std::pair<std::string, at::Tensor>>& params) {
  if (params.empty()) throw std::invalid_argument("FsdpUnit '" + name + "': expected parameters; got none");
  const at::Tensor& first = params.front().second;
  for (const auto& item : params) {
    const std::string& pname = item.first;
    const at::Tensor& p = item.second;
    auto fail = [&](const std::string& why) {
      throw std::invalid_argument("FSDP unit '" + name + "': parameter '" + pname + "' (" + describe(p) + ") " + why);
    };
    if (p.dim() == 0) fail("is a scalar; FSDP shards on dim 0 and needs at least one dimension");
    if (p.layout() != c10::kStrided) fail("is not a dense tensor");
    if (!p.is_contiguous()) fail("is not contiguous; expected contiguous parameters");
    if (p.scalar_type() != first.scalar_type() || p.device() != first.device())
      fail("differs in dtype or device from '" + params.front().first + "' (" + describe(first) +
           "); every parameter of a unit must share both");
  }
}

void FsdpUnit::discard_unsharded_gradients() {
  ++generation_;
  reducer_->discard();  // what it keeps between calls (HSDP's partial: this step's micro-batches so far) goes too
  count_reducer_bytes();
  for (size_t k = 0; k < params_.size(); ++k) {
    params_[k].param.mutable_grad().reset();
    accumulated_[k] = at::Tensor();
  }
  count_unsharded_gradients();
}

FsdpUnit::~FsdpUnit() {
  try {
    all_gather_.wait();  // it writes into our buffers
  } catch (...) {        // a destructor must not throw; finish_unshard reported (or will report) the error
  }
  // The registered parameters alias the gathered buffer, and the optimizer holds the sharded parameters, slots of
  // the sharded buffer: both may outlive this unit, its allocators and its pool (the model and the optimizer are the
  // user's), and a later regrow or resize must not reach an allocator that is gone. A block a storage holds now goes
  // back to the pool's state and is uncounted in the meter's, which both outlive their blocks.
  for (const at::Tensor* t : {&gathered_, &sharded_flat_})
    if (t->defined()) t->storage().unsafeGetStorageImpl()->set_allocator(device_allocator_);
}

bool FsdpUnit::has_frozen() const {
  for (const auto& fp : params_)
    if (!fp.trainable) return true;
  return false;
}

size_t FsdpUnit::trainable_count() const {
  size_t n = 0;
  for (const auto& fp : params_) n += fp.trainable ? 1 : 0;
  return n;
}

at::Tensor FsdpUnit::new_buffer(int64_t numel, c10::ScalarType dtype) const {
  return buffers_allocator_->empty(numel, dtype, sharded_flat_.device());
}

at::Tensor FsdpUnit::reduction_buffer(int64_t numel, c10::ScalarType dtype) const {
  if (pool_ != nullptr && sharded_flat_.is_cpu()) return pool_->empty(numel, dtype);
  return at::empty({numel}, sharded_flat_.options().dtype(dtype));
}

void FsdpUnit::check_block(const char* what, const at::Tensor& block, const GatherWire& expected,
                           const char* expected_is) const {
  if (block.defined() && block.numel() == expected.numel && block.scalar_type() == expected.dtype &&
      block.device() == sharded_flat_.device() && block.is_contiguous())
    return;
  throw std::invalid_argument("FSDP unit '" + name_ + "': the gather seam's " + what + " gave " +
                              (block.defined() ? describe(block) : std::string("an undefined tensor")) +
                              "; expected a contiguous block of " + std::to_string(expected.numel) + " " +
                              c10::toString(expected.dtype) + " on " + sharded_flat_.device().str() + " (" +
                              expected_is + ")");
}

BufferMaker FsdpUnit::buffer_maker() const {
  return [this](int64_t numel, c10::ScalarType dtype) { return new_buffer(numel, dtype); };
}

at::Tensor FsdpUnit::pack_block() const {
  at::Tensor block = gather_->pack(sharded_flat_, dtypes_.param, buffer_maker());
  check_block("pack", block, gather_->wire(shard_numel_, dtypes_.param), "its wire()");
  return block;
}

at::Tensor FsdpUnit::unpack_block(const at::Tensor& block) const {
  at::Tensor shards = gather_->unpack(block, shard_numel_, dtypes_.param, buffer_maker());
  check_block("unpack", shards, {shard_numel_, dtypes_.param}, "the padded shards in the param dtype");
  return shards;
}

void FsdpUnit::begin_unshard() {
  if (state_ != UnitState::kSharded) return;
  at::NoGradGuard no_grad;
  // BEGIN SOLUTION(04): issue one all-gather of this rank's block, as the seam packs it (the gathered buffer waits)
  all_gather_in_ = pack_block();
  all_gather_out_ = new_buffer(comm_.size() * all_gather_in_.numel(), all_gather_in_.scalar_type());
  all_gather_ = comm_.all_gather(all_gather_out_, all_gather_in_);
  state_ = UnitState::kUnsharding;
  // END SOLUTION
  emit(UnitEventKind::kBeginUnshard);
}

void FsdpUnit::copy_out(int r, const at::Tensor& shards, const at::Tensor& dst) const {
  // BEGIN SOLUTION(04): copy-out: rank r's real rows of every parameter from its padded shards into the parameter
  for (const auto& fp : params_) {
    const int64_t n = fp.spec.rows_of(r) * fp.spec.row_numel;
    if (n == 0) continue;
    dst.narrow(0, fp.gathered_offset + fp.spec.first_row_of(r) * fp.spec.row_numel, n)
        .copy_(shards.narrow(0, fp.shard_offset, n));
  }
  // END SOLUTION
}

void FsdpUnit::wait_for_all_gather() {
  const int64_t wait_start = now_ns();
  try {
    all_gather_.wait();
  } catch (const std::exception& e) {
    if (failure_.empty()) failure_ = e.what();
    throw;
  }
  // What the host waited for is recorded: it is exposed communication.
  comm_.recorder().record_wait("fsdp unshard", wait_start, now_ns());
  all_gather_ = Handle();  // done: what it kept of our buffers goes now, not at the next unshard
}

void FsdpUnit::finish_unshard() {
  if (state_ == UnitState::kUnsharded) return;
  if (state_ == UnitState::kSharded) begin_unshard();
  wait_for_all_gather();
  // BEGIN SOLUTION(04): every parameter holds its full value; nothing of the all-gather is kept
  regrow_storage(gathered_, gathered_capacity_bytes());
  {
    at::NoGradGuard no_grad;
    const at::Tensor blocks = all_gather_out_.view({comm_.size(), -1});
    for (int r = 0; r < comm_.size(); ++r)  // through the buffer: Note [Why the registered tensor never changes]
      copy_out(r, unpack_block(blocks[r]), gathered_);
  }
  all_gather_out_ = at::Tensor();
  all_gather_in_ = at::Tensor();
  state_ = UnitState::kUnsharded;
  // END SOLUTION
  emit(UnitEventKind::kFinishUnshard);
}

void FsdpUnit::cancel_unshard() {
  if (state_ != UnitState::kUnsharding) return;
  wait_for_all_gather();  // it writes into the buffer: wait before dropping it (and every rank completes it)
  all_gather_out_ = at::Tensor();
  all_gather_in_ = at::Tensor();
  state_ = UnitState::kSharded;
  emit(UnitEventKind::kReshard);
}

void FsdpUnit::reshard() {
  if (state_ == UnitState::kUnsharding) finish_unshard();
  if (state_ == UnitState::kSharded) return;
  // BEGIN SOLUTION(04): free the gathered buffer's bytes; the unit is sharded again
  free_storage(gathered_);
  state_ = UnitState::kSharded;
  // END SOLUTION
  emit(UnitEventKind::kReshard);
}

void FsdpUnit::stash_gradients() {
  if (dtypes_.reduce == dtypes_.param) return;  // autograd keeps adding into .grad(), already the reduce dtype
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < params_.size(); ++k) {
    at::Tensor& g = params_[k].param.mutable_grad();
    if (!params_[k].trainable || !g.defined()) continue;
    if (accumulated_[k].defined()) {
      accumulated_[k].add_(g);
    } else {
      accumulated_[k] = g.to(dtypes_.reduce);
    }
    g.reset();
    count_gradient(k);  // a new accumulator counted before the gradient it copied is released: their peak
  }
}

Handle FsdpUnit::reduce_gradients(std::vector<std::string>* missing) {
  const int world = comm_.size();
  at::NoGradGuard no_grad;
  at::Tensor input = reduction_buffer(world * grad_row_numel_, dtypes_.reduce).view({world, grad_row_numel_});
  at::Tensor output = reduction_buffer(grad_row_numel_, dtypes_.reduce);
  // BEGIN SOLUTION(04): fill `input` from the unsharded gradients (reducer.h: its layout); they are freed
  for (size_t k = 0; k < params_.size(); ++k) {
    const FsdpParam& fp = params_[k];
    if (!fp.trainable) continue;
    at::Tensor& g = fp.param.mutable_grad();
    at::Tensor
        full;  // this rank's whole unsharded gradient (copy_ casts it to the reduce dtype); undefined = none came
    if (accumulated_[k].defined()) {
      full = g.defined() ? accumulated_[k].add_(g) : accumulated_[k];
    } else if (g.defined()) {
      full = g;  // copy_ below casts to the reduce dtype: no whole cast copy
    } else if (missing != nullptr) {
      missing->push_back(fp.name);
    }
    const at::Tensor flat = full.defined() ? full.contiguous().view({-1}) : at::Tensor();
    for (int r = 0; r < world; ++r) {
      at::Tensor chunk = input[r].narrow(0, fp.grad_offset, fp.spec.padded_numel());
      const int64_t n = flat.defined() ? fp.spec.rows_of(r) * fp.spec.row_numel : 0;
      if (n > 0) chunk.narrow(0, 0, n).copy_(flat.narrow(0, fp.spec.first_row_of(r) * fp.spec.row_numel, n));
      chunk.narrow(0, n, chunk.numel() - n).zero_();
    }
    g.reset();  // the unsharded gradient is freed at once
    accumulated_[k] = at::Tensor();
  }
  // END SOLUTION
  Handle reduced = (*reducer_)(input.view({-1}), output);
  const ReductionBytes counted = count_reduction();  // Note [A reduction's bytes, phase by phase]
  emit(UnitEventKind::kReduceLaunched);
  Handle landed = std::move(reduced).then([this, output, counted, generation = generation_] {
    at::NoGradGuard no_grad;
    count_reducer_bytes();            // a deferred micro-batch's row joined the partial
    if (generation != generation_) {  // its backward threw: see discard_unsharded_gradients
      count_reduction_done(counted.second);
      emit(UnitEventKind::kReduceLanded);
      return;
    }
    // BEGIN SOLUTION(04): this rank's row of the average goes into the sharded gradients (accumulated if one is there)
    for (auto& fp : params_) {
      if (!fp.trainable) continue;
      const int64_t n = fp.sharded.numel();
      at::Tensor mine = output.narrow(0, fp.grad_offset, n).view(fp.sharded.sizes());
      at::Tensor& grad = fp.sharded.mutable_grad();
      if (grad.defined()) {
        grad.add_(mine.to(grad.scalar_type()));
      } else {
        grad = mine.to(dtypes_.orig, /*non_blocking=*/false, /*copy=*/true);  // its own memory, never a view
      }
    }
    // END SOLUTION
    count_sharded_gradients();
    count_reduction_done(counted.second);
    emit(UnitEventKind::kReduceLanded);
  });
  return std::move(landed).on_advance([this, first = counted.first] { count_reduction_done(first); });
}

std::vector<at::Tensor> FsdpUnit::gather_full_parameters() {
  at::NoGradGuard no_grad;
  at::Tensor blocks = at::empty({comm_.size() * shard_numel_}, sharded_flat_.options());
  comm_.all_gather(blocks, sharded_flat_).wait();  // the shards as they are: the full values exactly, not the seam's
  at::Tensor full = at::empty({gathered_numel_}, sharded_flat_.options());
  const at::Tensor rows = blocks.view({comm_.size(), shard_numel_});
  for (int r = 0; r < comm_.size(); ++r) copy_out(r, rows[r], full);
  std::vector<at::Tensor> out;
  for (const auto& fp : params_)
    out.push_back(full.narrow(0, fp.gathered_offset, fp.spec.numel()).view(fp.spec.sizes).clone());
  return out;
}

}  // namespace shardlab::fsdp
