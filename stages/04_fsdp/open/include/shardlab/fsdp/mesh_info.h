#pragma once
/// @file mesh_info.h
/// Where a FullyShardedModel sits among the ranks, as PyTorch FSDP2's FSDPMeshInfo and HSDPMeshInfo say it: the
/// group its parameters are sharded over and, under HSDP, the group of the ranks that hold the same shard (the
/// replicas) and its index among them. Everything FSDP does beyond one shard group is read from it:
///  - construction compares the ranks' models and broadcasts rank 0's state over every rank of the mesh;
///  - the ranks of the first replica write a checkpoint's rows, and the whole mesh agrees on the outcome;
///  - the gradient reduction's second phase (HSDP's all-reduce across replicas) runs on the replicate group, which
///    the ReducerFactory reads from ReducerRequest::mesh;
///  - clip_grad_norm joins the norm over the shard group only (the replicas hold the same rows).

#include "shardlab/core/comm/communicator.h"

namespace shardlab::fsdp {

/// A FullyShardedModel's place in the mesh. The groups are not owned: they must outlive the wrapper.
struct MeshInfo {
  Communicator* shard = nullptr;      ///< the S ranks the parameters are sharded over (required)
  Communicator* replicate = nullptr;  ///< HSDP: the R ranks that hold this rank's shard; null: one replica (FSDP)
  Communicator* mesh = nullptr;       ///< HSDP: every rank of the R x S mesh; null: the shard group is the mesh

  /// FSDP on one group: one replica, sharded over `shard`. (Stage 06 describes HSDP's mesh: hsdp::mesh_info.)
  static MeshInfo fsdp(Communicator& shard);

  /// R: the number of replicas (1 without a replicate group).
  int replicas() const { return replicate != nullptr ? replicate->size() : 1; }
  /// This rank's replica, in [0, R): its rank in the replicate group (whose ranks are ordered by replica, as a
  /// Mesh's columns are), 0 without one. Derived, so that no rank can hold an index the others disagree with.
  int replica() const { return replicate != nullptr ? replicate->rank() : 0; }
  /// Every rank of the mesh: `mesh`, or the shard group when there is one replica.
  Communicator& everyone() const { return mesh != nullptr ? *mesh : *shard; }
  /// True on the ranks whose rows a checkpoint keeps: the first replica's.
  bool saves() const { return replica() == 0; }
  /// Checks what every rank sees alike (the groups' sizes), so that a malformed description fails on every rank
  /// before any collective.
  /// @throws std::invalid_argument naming `who` and what is wrong: no shard group; a replicate group without the
  ///         mesh group or the other way round; a mesh group whose size is not R · S.
  void check(const char* who) const;
};

}  // namespace shardlab::fsdp
