#pragma once
/// @file hsdp_reducer.h
/// Stage 06, part 1 — HSDP's gradient reduction: within the shard group a reduce-scatter (each rank gets the sum of
/// its rows over the S ranks that share its replica), then across the replicas an all-reduce of that row (the sum
/// over the R ranks that hold the same shard), and one division by N = R · S.
///
/// Vocabulary (a mesh of R replicas × S shards, N = R · S ranks; see Mesh in common):
///  - *shard group*: the S ranks of one replica (a row of the mesh); parameters are sharded over it.
///  - *replicate group*: the R ranks that hold the same shard (a column); their shards must stay bit-identical.
///  - *one divide*: the average over N ranks is computed as `sum(g / pre) / post` with pre · post = N, the factors
///    of gradient_predivide_factor(N) (Note [Pre- and post-division] in stage 03): never once per group (a division
///    by S and then by R rounds twice, and a reducer that forgets one of them trains R or S times too fast).
///
/// References: PyTorch FSDP2's HSDP (`fully_shard` on a 2-D DeviceMesh: foreach_reduce's reduce-scatter, then the
/// all-reduce on the replicate group); the seed's HSDP gradient pre-divide (`../shared/seeds/003_*`).

#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/comm/wire.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/parallel/standard_facets.h"
#include "shardlab/fsdp/reducer.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardlab::hsdp {

/// 0.1's names of shardlab::Wire and shardlab::parse_wire (core/comm/wire.h), for one release.
using Wire = shardlab::Wire;
using shardlab::parse_wire;

/// One unit's HSDP reduction: a reduce-scatter in `shard` and then an all-reduce in `replicate`, chained with
/// Handle::then_issue, so that FSDP's advance() before the next unit's reduce-scatter issues this unit's all-reduce
/// without waiting for it (Note [Advancing a chained reduction] in common).
///
/// Contract (GradientReducer's, over N = shard.size() · replicate.size() ranks):
///  - `input` holds S rows of `output.numel()` elements (rank-major, flat, the reduce dtype); after the handle's
///    `wait()`, `output` holds this rank's row of the mean over all N ranks, divided once (see the file comment);
///    `input` is scratch, freed as soon as the reduce-scatter has landed (GradientReducer's contract).
///  - A compressed wire (fp16/bf16) communicates in its dtype on both groups and casts the mean back into
///    `output`'s dtype.
///  - With one replica (R = 1) it is stage 04's reduction exactly: no all-reduce at all.
///  - Every rank of both groups calls it for the same units in the same order.
class HsdpReducer final : public fsdp::GradientReducer {
 public:
  /// `shard` and `replicate` must outlive the reducer and its handles.
  HsdpReducer(Communicator& shard, Communicator& replicate, Wire wire = Wire::kReduceDtype);
  /// Starts the reduce-scatter; the all-reduce follows at the handle's advance() (see the class comment).
  /// @throws std::invalid_argument naming what was expected and what came: undefined, non-contiguous or
  ///         non-floating tensors, different dtypes, or input.numel() != S · output.numel().
  Handle operator()(const at::Tensor& input, const at::Tensor& output) override;
  /// A compressed wire's copies (the cast input and the reduced row), and what the Communicator holds for the
  /// reduce-scatter.
  int64_t scratch_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const override;
  /// With more than one replica: the output row, a compressed wire's row, and what the Communicator holds for the
  /// all-reduce (Gloo 1.13's f32 copy of a bf16 row), all held from the advance to the wait. One replica: 0 (one
  /// phase).
  int64_t second_phase_bytes(c10::ScalarType dtype, int64_t input_numel, c10::Device device) const override;
  /// partial_bytes().
  int64_t held_bytes() const override { return partial_bytes(); }
  /// True while a partial is held (the all-reduce deferred).
  bool deferred() const override { return partial_bytes() > 0; }
  /// One row of `output_numel` elements of `dtype`: the partial of a deferred all-reduce.
  int64_t deferred_bytes(c10::ScalarType dtype, int64_t output_numel) const override;
  /// "hsdp", "hsdp_fp16", "hsdp_bf16".
  std::string name() const override;
  /// N: the ranks the mean is over.
  int ranks() const { return shard_.size() * replicate_.size(); }

  /// With false, later calls reduce-scatter as usual but only add the row (pre-divided, summed over the shard group)
  /// into this unit's *partial* buffer (in `output`'s dtype) and leave zeros in `output`: no all-reduce, nothing but
  /// zeros reaches the shard's gradient yet (do not step the optimizer then: AdamW would still decay and count a
  /// step). The next call with true adds the partial into its row before the all-reduce, so the gradient of a step
  /// of k micro-batches costs k reduce-scatters and one all-reduce (FSDP2's set_requires_all_reduce). Set on every
  /// rank alike, between backward passes. See set_requires_all_reduce in hsdp.h.
  void set_requires_all_reduce(bool on) { requires_all_reduce_ = on; }
  /// See set_requires_all_reduce.
  bool requires_all_reduce() const { return requires_all_reduce_; }
  /// Bytes of the partial buffer held between micro-batches (0 when none is pending).
  int64_t partial_bytes() const;
  /// Drops the partial buffer (every deferred micro-batch of the step so far, as a backward that throws under no_sync
  /// loses the unsharded gradients kept so far); deferred calls still in flight add nothing to it.
  void discard() override;

 private:
  Communicator& shard_;
  Communicator& replicate_;
  Wire wire_;
  bool requires_all_reduce_ = true;
  at::Tensor partial_;       // the rows of deferred micro-batches, summed (output dtype); undefined when none pending
  uint64_t generation_ = 0;  // bumped by discard(): deferred calls of an older generation keep nothing
};

/// The switch of every HsdpReducer one wrapper's factory made: the hybrid wrapper's ReplicaSync facet
/// (standard_facets.h), which fully_shard_hybrid attaches, so that deferring reaches every unit's reducer without
/// asking a unit what its reducer is.
class HsdpSwitch : public ReplicaSync {
 public:
  /// Sets every reducer added so far (HsdpReducer::set_requires_all_reduce), and those added later.
  void set_requires_all_reduce(bool requires_all_reduce) override;
  /// Adds `reducer`, giving it the switch's current setting; the switch does not keep it alive.
  void add(const std::shared_ptr<HsdpReducer>& reducer);
  /// How many reducers it sets (those still alive).
  size_t size() const;

 private:
  bool requires_all_reduce_ = true;
  std::vector<std::weak_ptr<HsdpReducer>> reducers_;
};

/// The ReducerFactory of HSDP: each unit gets an HsdpReducer on the shard and replicate groups of the wrapper's
/// mesh (ReducerRequest::mesh, from the MeshInfo FullyShardedModel was built on: mesh_info(mesh) in hsdp.h), added
/// to `sync` when one is given.
/// @throws std::invalid_argument (from a request) when the wrapper's mesh has no replicate group (a MeshInfo of
///         FSDP on one group).
fsdp::ReducerFactory hsdp_reducers(Wire wire = Wire::kReduceDtype, std::shared_ptr<HsdpSwitch> sync = nullptr);

}  // namespace shardlab::hsdp
