#pragma once
/// @file fsdp_unit.h
/// Stage 04, part 2 — one FSDP unit: the parameters that are sharded, gathered and reduced together (FSDP2's
/// FSDPParamGroup), and the state machine that says where they are.
///
/// Vocabulary (S = ranks of the group, r = this rank):
///  - *sharded parameter*: this rank's real rows of a parameter, in its original dtype; the leaf tensor the
///    optimizer steps. A slot of the unit's *sharded buffer*, which holds this rank's padded shard of every
///    parameter back to back (Σ padded shard numel elements; padding zero).
///  - *gathered parameter*: the module's own registered tensor, full shape, in the param dtype: what the forward
///    and backward compute with. A slot of the unit's *gathered buffer* (Σ numel elements), whose storage has
///    0 bytes whenever the unit is sharded (see Note [Freeing storage that autograd saved] in common).
///  - *all-gather buffer*: S blocks of Σ padded shard numel, block r = rank r's sharded buffer; alive only while
///    the unit is unsharding. *Copy-out* moves each rank's real rows from it into the gathered buffer.
///  - *reduce-scatter input*: S rows of Σ padded numel of the trainable parameters, row r = rank r's padded
///    chunk of every unsharded gradient (rank-major). After the reduce-scatter, this rank holds row r averaged
///    over the ranks: exactly its sharded gradients, padding included (the padding is dropped).
///
/// States (UnitState): sharded -> unsharding (its all-gather issued) -> unsharded (copied out) -> sharded.
///  - sharded:    gathered buffer at 0 bytes; no all-gather in flight.
///  - unsharding: the all-gather is in flight into the all-gather buffer; the gathered buffer still has 0 bytes (it
///    gets them at copy-out, so a unit prefetched early holds only what its all-gather needs).
///  - unsharded:  every gathered parameter holds the full values (bit for bit the shards, cast to param dtype).
/// @cond INTERNAL
/// The transitions are begin_unshard, finish_unshard and reshard; begin_unshard / finish_unshard are split so that
/// stage 05 can issue the next unit's all-gather early.
/// @endcond

#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/storage/buffer_pool.h"
#include "shardlab/fsdp/gather.h"
#include "shardlab/fsdp/memory.h"
#include "shardlab/fsdp/mixed_precision.h"
#include "shardlab/fsdp/reducer.h"
#include "shardlab/fsdp/shard_layout.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::fsdp {

/// Where a unit's parameters are (see the states in the file comment).
enum class UnitState { kSharded, kUnsharding, kUnsharded };

/// "sharded", "unsharding", "unsharded".
const char* to_string(UnitState state);

/// What happened to a unit: the transitions of its state machine and its gradients' reduction (what an observer of
/// the schedule sees; see FullyShardedModel::set_observer).
enum class UnitEventKind {
  kBeginUnshard,    ///< sharded -> unsharding: its all-gather was issued
  kFinishUnshard,   ///< unsharding -> unsharded: the all-gather landed and was copied out
  kReshard,         ///< unsharded -> sharded: the gathered buffer went back to 0 bytes
  kReduceLaunched,  ///< its gradients' reduce-scatter was issued
  kReduceLanded,    ///< that reduce-scatter completed and was waited for (its result applied, or dropped after a
                    ///< backward that threw)
};

/// "begin_unshard", "finish_unshard", "reshard", "reduce_launched", "reduce_landed".
const char* to_string(UnitEventKind kind);

/// One parameter managed by a unit.
struct FsdpParam {
  std::string name;        ///< the model's name for it ("block0.fc.weight")
  at::Tensor param;        ///< the module's registered tensor: full shape, param dtype, gathered-buffer slot
  at::Tensor sharded;      ///< this rank's real rows, original dtype: what the optimizer steps
  ShardSpec spec;          ///< how it is split over the group
  bool trainable = false;  ///< requires grad (frozen parameters are gathered but never reduced)
  /// @cond INTERNAL
  int64_t shard_offset = 0;     ///< first element of its padded shard in the sharded buffer (and in each block)
  int64_t gathered_offset = 0;  ///< first element of the full parameter in the gathered buffer
  int64_t grad_offset = -1;     ///< first element of its padded chunk in a reduce-scatter row; -1 when frozen
  /// @endcond
};

/// The parameters of one unit: sharded at construction, gathered on demand, their gradients reduce-scattered.
///
/// Contract:
/// @cond INTERNAL
///  - Every rank constructs the unit with the same parameters (same names, shapes and dtypes, same order) and
///    calls the collectives (unshard, reduce_gradients, gather_full_parameters) in the same order.
///  - Construction keeps this rank's shard of each parameter's current values and turns the registered tensor
///    into a slot of the gathered buffer; the unit starts sharded.
/// @endcond
///  - The communicator, the meter and the parameters' module outlive the unit. Not copyable or movable.
///
/// The wrapper's own calls (construction, the transitions, the reduction) are internal: the guided track's design
/// of a unit, which the open track's header leaves out (tools/gen_open.py drops the blocks marked internal).
class FsdpUnit {
 public:
  /// @cond INTERNAL
  /// Shards `params` (name, registered tensor) over `comm`.
  /// @param name the unit's name, for errors and reports.
  /// @param params (the model's name, the registered tensor) of every parameter of the unit, each once.
  /// @param comm the shard group; every rank of it constructs the same unit.
  /// @param policy mixed precision; resolved per unit with resolve_dtypes.
  /// @param reducer what the gradients go through (stage 03's reduce-scatter hooks through hook_reducer: fp32
  ///        average, fp16, bf16; HSDP's in stage 06). It reduces over `comm` and whatever groups it holds itself.
  /// @param meter counts every buffer the unit allocates and frees.
  /// @param pool where the unit's buffers come from (CPU tensors only; null: the device's allocator). It must
  ///        outlive the unit. See Note [Why FSDP pools its buffers] in common.
  /// @param gather how its all-gather packs and unpacks the shards (gather.h); null: cast_gather().
  /// @throws std::invalid_argument naming the parameter for a scalar, a non-contiguous or a non-dense parameter,
  ///         for parameters of different dtypes or devices in one unit, for an empty unit and for a null reducer.
  FsdpUnit(std::string name, const std::vector<std::pair<std::string, at::Tensor>>& params, Communicator& comm,
           const MixedPrecision& policy, std::shared_ptr<GradientReducer> reducer, MemoryMeter& meter,
           BufferPool* pool = nullptr, std::shared_ptr<const GatherSeam> gather = nullptr);
  /// @endcond
  ~FsdpUnit();
  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  /// The unit's name ("block0"; "root" for the parameters outside every unit).
  const std::string& name() const { return name_; }
  /// Where the parameters are now.
  UnitState state() const { return state_; }
  /// Empty, or the error of the unit's all-gather that failed: its parameters never arrived, it stays unsharding,
  /// and every later wait on it rethrows that error.
  const std::string& failure() const { return failure_; }
  /// The managed parameters, in the order given.
  const std::vector<FsdpParam>& params() const { return params_; }
  /// The dtypes after clamping.
  const UnitDtypes& dtypes() const { return dtypes_; }
  /// True when some parameter is frozen.
  bool has_frozen() const;
  /// Number of trainable parameters.
  size_t trainable_count() const;
  /// The reducer the unit's gradients go through (Options::reducer's for this unit).
  GradientReducer& reducer() { return *reducer_; }
  /// The reducer, read-only.
  const GradientReducer& reducer() const { return *reducer_; }

  /// @cond INTERNAL
  /// sharded -> unsharding: issues one all-gather of the padded shards (cast to the param dtype) into a new
  /// all-gather buffer. No-op in any other state. A collective.
  void begin_unshard();
  /// unsharding -> unsharded: waits for the all-gather (recorded as the wait "fsdp unshard"), gives the gathered
  /// buffer its bytes and copies every rank's real rows out into it; the all-gather buffer is freed. From sharded it
  /// begins first. No-op when unsharded.
  /// @throws std::runtime_error (from the Communicator) when the all-gather fails or times out.
  void finish_unshard();
  /// begin_unshard() then finish_unshard().
  void unshard() {
    begin_unshard();
    finish_unshard();
  }
  /// unsharded -> sharded: the gathered buffer goes back to 0 bytes. An all-gather in flight is finished first
  /// (it writes into that buffer). No-op when sharded.
  void reshard();
  /// unsharding -> sharded without using the result: waits for the all-gather in flight, then drops its buffers
  /// (no copy-out, the gathered buffer never gets its bytes). Emits kReshard. No-op in any other state.
  void cancel_unshard();
  /// @endcond

  /// Bytes the gathered buffer holds now (0 while sharded).
  int64_t gathered_bytes() const;
  /// Bytes the gathered buffer holds while unsharded.
  int64_t gathered_capacity_bytes() const;
  /// Bytes of the sharded buffer (this rank's padded shards).
  int64_t sharded_bytes() const;
  /// Bytes the unit's own buffers of an all-gather in flight should hold, in theory: its output (S blocks of what the
  /// gather seam sends: the padded shards in the param dtype by default) and what the seam packs (GatherSeam::
  /// pack_bytes: by default, with a param dtype that differs from the original, the cast shards it sends). What the
  /// meter measures is counted where it is allocated (Note [Counting a unit's memory]), not from this.
  int64_t all_gather_bytes() const;
  /// Bytes the gather seam makes to unpack one rank's block at the copy-out (GatherSeam::unpack_bytes; 0 by default).
  int64_t unpack_bytes() const;
  /// Bytes the Communicator holds privately while the unit's all-gather is in flight
  /// (Communicator::all_gather_scratch_bytes: bf16 on Gloo, Gloo's own all-gather), which the meter does not count.
  int64_t all_gather_comm_bytes() const;
  /// Bytes the all-gather buffer holds now (its storage; 0 unless an all-gather is in flight).
  int64_t all_gather_bytes_held() const;
  /// Bytes of the unsharded gradients of the trainable parameters (param dtype), all of them at once.
  int64_t unsharded_grad_bytes() const;
  /// Bytes a reduce-scatter of this unit holds while in flight: its input (S rows of the padded gradients) and
  /// output (one row) in the reduce dtype, and the reducer's private copies
  /// (GradientReducer::scratch_bytes). 0 for a unit without trainable parameters.
  int64_t reduce_bytes() const;
  /// Of reduce_bytes(), what a reduction still holds after it has been advanced, until it is waited for: its
  /// output row and the reducer's second phase (GradientReducer::second_phase_bytes; 0 for a one-phase reducer).
  /// See Note [A reduction's bytes, phase by phase]. 0 for a unit without trainable parameters.
  int64_t second_phase_bytes() const;
  /// What the reducer keeps between micro-batches that all reduce (GradientReducer::deferred_bytes of one row).
  int64_t deferred_bytes() const;

  /// @cond INTERNAL
  /// Counts params()[k]'s unsharded gradient in the meter (as it is now: a gradient freed since is no longer
  /// counted). Called by the wrapper when the gradient has been accumulated.
  void note_gradient(size_t k);
  /// Inside no_sync: when the reduce dtype differs from the param dtype, moves the unsharded gradients into
  /// accumulators of the reduce dtype (FSDP2's unsharded_accumulated_grad), so micro-batches add up in it;
  /// otherwise they stay in `.grad()`, where autograd keeps adding.
  void stash_gradients();
  /// Lays every trainable parameter's unsharded gradient (plus what stash_gradients kept) out rank-major in the
  /// reduce dtype, frees them, and reduces them through the reducer. When the returned handle's `wait()` returns,
  /// each sharded parameter's `.grad()` holds (or has been increased by) the average over ranks of its rows, in
  /// the original dtype. A trainable parameter with no gradient at all counts as zero and is appended to
  /// `missing` (when non-null). A collective.
  Handle reduce_gradients(std::vector<std::string>* missing);

  /// Drops every unsharded gradient and accumulator, and makes reductions still in flight land nowhere (after a
  /// backward that threw: nothing it left may reach the next step's gradients). Not a collective.
  void discard_unsharded_gradients();

  /// Calls `sink` with every event of this unit from now on (UnitEventKind), on the thread that caused it; an empty
  /// function stops it. Only real transitions are reported: a begin_unshard that was a no-op reports nothing.
  void set_event_sink(std::function<void(UnitEventKind)> sink) { sink_ = std::move(sink); }

  /// Throws what the constructor would throw for these parameters, building nothing (so a wrapper can check every
  /// unit before it changes any). @throws std::invalid_argument as the constructor.
  static void validate(const std::string& name, const std::vector<std::pair<std::string, at::Tensor>>& params);

  /// Every parameter's full values in the original dtype (fresh tensors, whatever the state), from one
  /// all-gather of the shards. A collective.
  std::vector<at::Tensor> gather_full_parameters();
  /// @endcond

 private:
  void wait_for_all_gather();  // all_gather_.wait(), recorded as the wait "fsdp unshard"; keeps the first failure
  // Copy-out of rank r: its real rows of every parameter, from `shards` (rank r's padded shards, dst's dtype), into
  // `dst` (the unit's parameters, flat).
  void copy_out(int r, const at::Tensor& shards, const at::Tensor& dst) const;
  // A parameter buffer (the all-gather's, the seam's), counted where it is allocated: from the pool when there is
  // one, else the device's allocator.
  at::Tensor new_buffer(int64_t numel, c10::ScalarType dtype) const;
  BufferMaker buffer_maker() const;  // new_buffer, for the gather seam
  // This rank's block for the all-gather, as the gather seam packs the sharded buffer (gather.h).
  at::Tensor pack_block() const;
  // One rank's received block as the gather seam unpacks it: its padded shards in the param dtype, for copy_out.
  at::Tensor unpack_block(const at::Tensor& block) const;
  // Throws std::invalid_argument naming the unit when what the gather seam's `what` (pack, unpack) gave is not a
  // contiguous block of `expected` on the unit's device; `expected_is` says what that block is.
  void check_block(const char* what, const at::Tensor& block, const GatherWire& expected,
                   const char* expected_is) const;
  // A reduction's buffer, from the pool when there is one (counted at the reduction's events).
  at::Tensor reduction_buffer(int64_t numel, c10::ScalarType dtype) const;
  // Reports `kind` to the sink.
  void emit(UnitEventKind kind);

  // The meter's counts (fsdp_unit_memory.cpp; Note [Counting a unit's memory]). Nothing else calls the meter.
  // A tensor the meter counts by what it holds now: the storage counted, and its bytes.
  struct Counted {
    const c10::StorageImpl* storage = nullptr;
    int64_t bytes = 0;
  };
  // What a reduction counts from its launch: released at its advance (`first`) and when it lands (`second`).
  struct ReductionBytes {
    int64_t first = 0;
    int64_t second = 0;
  };
  void count(MemoryKind kind, Counted& counted, const at::Tensor& now);  // `counted` becomes what `now` holds
  void count_gradient(size_t k);             // params_[k]'s accumulator, then its unsharded gradient, as they are now
  void count_unsharded_gradients();          // every parameter's, by count_gradient
  void count_sharded_gradients();            // the sharded gradients, as they are now
  void count_reducer_bytes();                // the reducer's held_bytes(), as it is now
  ReductionBytes count_reduction();          // a reduction just launched: its buffers, and the gradients it freed
  void count_reduction_done(int64_t bytes);  // a reduction freed a part of what count_reduction counted

  std::string name_;
  Communicator& comm_;
  UnitDtypes dtypes_;
  std::shared_ptr<GradientReducer> reducer_;
  MemoryMeter& meter_;
  BufferPool* pool_;                          // null: the device's allocator
  std::shared_ptr<const GatherSeam> gather_;  // never null
  // Count the parameters' buffers in meter_ where they are allocated: the shards, and the rest (pooled on CPU).
  c10::Allocator* device_allocator_ = nullptr;  // what at::empty uses on the parameters' device
  std::unique_ptr<CountingAllocator> shards_allocator_, buffers_allocator_;
  std::vector<FsdpParam> params_;
  int64_t shard_numel_ = 0;              // Σ padded shard numel: the sharded buffer, one block of the all-gather
  int64_t gathered_numel_ = 0;           // Σ numel: the gathered buffer
  int64_t grad_row_numel_ = 0;           // Σ padded shard numel of the trainable parameters: one reduce-scatter row
  at::Tensor sharded_flat_;              // [shard_numel_], original dtype
  at::Tensor gathered_;                  // [gathered_numel_], param dtype; 0 bytes while sharded
  at::Tensor all_gather_out_;            // S blocks of the gather seam's wire; only while unsharding
  at::Tensor all_gather_in_;             // this rank's block (the seam's pack); only while unsharding
  Handle all_gather_;                    // pending while unsharding
  std::vector<at::Tensor> accumulated_;  // per parameter: stash_gradients' reduce-dtype accumulator, or undefined
  // What the meter counts now of the gradients: per parameter its unsharded gradient, its accumulator and its
  // sharded gradient; the reducer's held_bytes(). (The parameters' buffers count themselves: CountingAllocator.)
  std::vector<Counted> counted_unsharded_, counted_accumulated_, counted_sharded_;
  int64_t reducer_bytes_ = 0;
  std::function<void(UnitEventKind)> sink_;  // set_event_sink
  UnitState state_ = UnitState::kSharded;
  std::string failure_;      // see failure()
  uint64_t generation_ = 0;  // bumped by discard_unsharded_gradients: older reductions are dropped on arrival
};

}  // namespace shardlab::fsdp
