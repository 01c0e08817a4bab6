#pragma once
/// @file thread_ranks.h
/// The multi-rank test harness: N ranks as threads of one process, each with its own real c10d Gloo process
/// group, all rendezvousing through one shared HashStore.

#include "shardlab/core/comm/process_group.h"
#include "shardlab/core/comm/world.h"

#include <functional>

namespace shardlab {

/// Runs `fn(comm)` on `world_size` threads, rank r getting a Communicator of rank r over a fresh HashStore, and
/// joins them. Each rank has its own CommRecorder.
/// @throws std::runtime_error "rank R: <what>" for the first rank (lowest index) whose `fn` threw; the other ranks'
///         collectives then fail by their timeout (options.timeout), so nothing hangs.
void run_ranks(int world_size, const std::function<void(Communicator&)>& fn, const GroupOptions& options = {});

/// Runs `fn(world)` on `world_size` threads, rank r getting the World of rank r over one fresh HashStore, and joins
/// them; `fn` makes the groups it needs (World::world, World::group, Mesh). Every rank's World, with its groups,
/// lives until every rank is done. Errors as run_ranks.
void run_world(int world_size, const std::function<void(World&)>& fn, const GroupOptions& options = {});

}  // namespace shardlab
