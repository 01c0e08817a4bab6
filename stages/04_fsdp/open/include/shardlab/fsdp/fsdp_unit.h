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
};

/// The parameters of one unit: sharded at construction, gathered on demand, their gradients reduce-scattered.
///
/// Contract:
///  - The communicator, the meter and the parameters' module outlive the unit. Not copyable or movable.
///
/// The wrapper's own calls (construction, the transitions, the reduction) are internal: the guided track's design
/// of a unit, which the open track's header leaves out (tools/gen_open.py drops the blocks marked internal).
class FsdpUnit {
 public:
  ~FsdpUnit();
  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  /// The unit's name ("block0"; "root" for the parameters outside every unit).
  const std::string& name() const;
  /// Where the parameters are now.
  UnitState state() const;
  /// Empty, or the error of the unit's all-gather that failed: its parameters never arrived, it stays unsharding,
  /// and every later wait on it rethrows that error.
  const std::string& failure() const;
  /// The managed parameters, in the order given.
  const std::vector<FsdpParam>& params() const;
  /// The dtypes after clamping.
  const UnitDtypes& dtypes() const;
  /// True when some parameter is frozen.
  bool has_frozen() const;
  /// Number of trainable parameters.
  size_t trainable_count() const;
  /// The reducer the unit's gradients go through (Options::reducer's for this unit).
  GradientReducer& reducer();
  /// The reducer, read-only.
  const GradientReducer& reducer() const;

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

 private:
  // Your state: the open track gives none of the solution's members.
};

}  // namespace shardlab::fsdp
