#pragma once
/// @file hsdp.h
/// Stage 06 — hybrid sharded data parallelism (HSDP): FSDP within each replica of a 2-D mesh (a row: the S ranks of
/// one machine, say), plain data parallelism across the replicas (the R rows). Parameters are sharded S ways, not
/// N ways, so all-gathers and reduce-scatters stay inside a row; each gradient shard is then all-reduced across
/// the R ranks that hold the same shard. FSDP2's `fully_shard(model, mesh=2-D DeviceMesh)`.
///
/// Per step, per unit: stage 04's all-gathers in the shard group, one reduce-scatter in the shard group and one
/// all-reduce (of the shard's Σ padded numel) in the replicate group. Every rank trains exactly like one device on
/// the union of all N ranks' batches, and the R ranks of a column hold bit-identical shards after every step.

#include "shardlab/core/comm/world.h"
#include "shardlab/core/model/model.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/hsdp/hsdp_reducer.h"

#include <memory>

namespace shardlab::hsdp {

/// The description of `mesh` that FullyShardedModel reads (FSDP2's HSDPMeshInfo): sharded over this rank's row
/// (`mesh.shard_group()`), replicated over its column (`mesh.replicate_group()`), this rank's replica its row, and
/// the whole mesh the world group of `mesh.world()`: so that construction compares and broadcasts over every rank,
/// the first replica's ranks save, and HsdpReducer finds its second group. A mesh of one replica (1 x S) gives
/// FSDP on the row, with a replicate group of one rank. A collective only the first time the world group is used
/// (World::world() makes it: every rank of the world calls alike).
fsdp::MeshInfo mesh_info(Mesh& mesh);

/// Wraps `model` for HSDP on `mesh`: stage 04's FullyShardedModel on mesh_info(mesh), sharded over the
/// mesh's row, which broadcasts global rank 0's state over the whole mesh once its checks passed (so that every
/// replica starts from the same values, not only every rank of a row), with an HsdpReducer per unit on the mesh's
/// groups. `options.reducer` must be empty (HSDP sets it); everything else of stage 04 and 05
/// (mixed precision, reshard after forward, no_sync, prefetch through prefetch::enable_prefetch) works unchanged.
/// The wrapper offers the facet ReplicaSync (standard_facets.h): its reducers' HsdpSwitch, which
/// set_requires_all_reduce below flips. The model and the mesh must outlive the wrapper. A collective on the whole
/// world.
/// @throws std::invalid_argument for a null model or a reducer already set in `options`, and as
///         FullyShardedModel does, before any collective.
std::unique_ptr<fsdp::FullyShardedModel> fully_shard_hybrid(std::shared_ptr<Model> model, Mesh& mesh,
                                                            fsdp::Options options = {}, Wire wire = Wire::kReduceDtype);

/// Sharded construction of HSDP, for a model larger than one rank: stage 04's FullyShardedModel(ModelBuilder, ...)
/// on the mesh's shard group, each unit sharded S ways as the model registers it. Nothing is broadcast: every rank
/// of every replica builds the same values from the same seed, and the build's outcome and the structure are
/// compared over the whole world. Otherwise as the other overload. A collective on the whole world.
/// @param build makes the model on the CPU, each unit initialized before it is registered (model.h).
/// @param mesh the 2-D mesh: sharded over its shard group, replicated over its replicate group.
/// @param options as the other overload's (reducer empty).
/// @param wire the dtype of both groups' reductions.
/// @param device where the units go as they are built.
/// @throws as the other overload, and as FullyShardedModel's sharded construction.
std::unique_ptr<fsdp::FullyShardedModel> fully_shard_hybrid(const ModelBuilder& build, Mesh& mesh,
                                                            fsdp::Options options = {}, Wire wire = Wire::kReduceDtype,
                                                            const c10::Device& device = c10::Device(c10::kCPU));

/// Defers (false) or restores (true) the all-reduce across replicas of every unit of `fsdp` (an HSDP wrapper made
/// by fully_shard_hybrid): for gradient accumulation, run the first k-1 micro-batches with false and the last with
/// true; each unit then reduce-scatters every micro-batch and all-reduces once. Unlike `no_sync()` (which skips
/// both collectives and keeps the unsharded gradients, one full unit per unit), the deferred micro-batches hold
/// only one row per unit. Call on every rank alike, between backward passes.
/// @throws std::invalid_argument when `fsdp` has no ReplicaSync facet (not made by fully_shard_hybrid, nor given an
///         HsdpSwitch by hand: hsdp_reducers(wire, sync) and attach<ReplicaSync>(sync)), naming its units' reducer.
void set_requires_all_reduce(fsdp::FullyShardedModel& fsdp, bool requires_all_reduce);

}  // namespace shardlab::hsdp
