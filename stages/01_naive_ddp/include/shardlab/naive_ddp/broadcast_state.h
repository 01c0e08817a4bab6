#pragma once
/// @file broadcast_state.h
/// Stage 01 — the replicas' common start: rank 0's parameters and buffers on every rank.
///
/// A header of its own (defined in naive_ddp.cpp, task 1) so that later stages include it without naive_ddp.h,
/// whose private state is the student's (see Note [A starter's headers] in cmake/ShardLabStage.cmake).

#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/model.h"

namespace shardlab::naive_ddp {

/// Whether broadcast_state compares the ranks' models first.
enum class StructureCheck {
  kCompare,          ///< check_same_model first (one all-gather of a digest)
  kAlreadyCompared,  ///< the caller did, at its start, before any check of its own that a rank could fail alone
};

/// Broadcasts every parameter (frozen ones included) and every buffer of `module` from rank 0 of `comm`, so all
/// replicas start identical. A collective: every rank must call it with a model of the same structure, which it
/// checks first unless told that the caller did (every wrapper does, first thing in its constructor). Later stages
/// start their replicas with it too.
/// @throws std::invalid_argument on every rank when the ranks' models differ, naming the first difference.
void broadcast_state(Model& module, Communicator& comm, StructureCheck check = StructureCheck::kCompare);

}  // namespace shardlab::naive_ddp
