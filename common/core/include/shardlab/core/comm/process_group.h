#pragma once
/// @file process_group.h
/// Making Communicators: from the environment torchrun sets (processes over a TCPStore), or from an explicit
/// store (threads in one process over one shared HashStore; see thread_ranks.h).

#include "shardlab/core/comm/communicator.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace shardlab {

/// How to build a process group.
struct GroupOptions {
  BackendKind kind = BackendKind::kGloo;      ///< Gloo (CPU) or NCCL (CUDA, when compiled in)
  std::chrono::milliseconds timeout{60'000};  ///< per collective and for the rendezvous
  std::string hostname = "127.0.0.1";         ///< address Gloo binds to; "" = this host's default device
  /// Compare every collective across the ranks before it is sent (Communicator::set_check_collectives), for
  /// finding a rank that issues another size. make_communicator also turns it on when the environment has
  /// SHARDLAB_CHECK_COLLECTIVES=1.
  bool check_collectives = false;
  /// When set, make_communicator hands it each backend it creates, with the rank, and builds the Communicator on
  /// what it returns: a wrapper that forwards to the real backend (delay or fault injection, tracing), as c10d's
  /// own ProcessGroupWrapper does. The wrapper must forward every op the Communicator issues (communicator.h:
  /// allreduce, broadcast, allgather, _allgather_base, _reduce_scatter_base, send, recv, barrier).
  std::function<c10::intrusive_ptr<compat::Backend>(c10::intrusive_ptr<compat::Backend>, int rank)> wrap_backend;
};

/// The variables torchrun sets for each process.
struct RankEnv {
  int rank = 0;             ///< RANK: global rank
  int world_size = 1;       ///< WORLD_SIZE
  int local_rank = 0;       ///< LOCAL_RANK: rank on this machine (selects the GPU)
  std::string master_addr;  ///< MASTER_ADDR: host of rank 0's TCPStore
  int master_port = 0;      ///< MASTER_PORT

  /// Reads and validates RANK, WORLD_SIZE, LOCAL_RANK (defaults to RANK), MASTER_ADDR, MASTER_PORT.
  /// @throws std::invalid_argument naming the variable, what was expected and what it held.
  static RankEnv from_environment();
};

/// `options` as a process launched with `env` needs them: across machines (MASTER_ADDR not this host's loopback)
/// Gloo binds to this host's default device instead of 127.0.0.1, so that the others can reach it.
GroupOptions reachable(const RankEnv& env, GroupOptions options);

/// Creates a Communicator for `rank` of `size` that rendezvous through `store` under the key prefix `name`.
/// Several groups may share one store as long as their names differ.
std::shared_ptr<Communicator> make_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                const std::string& name, const GroupOptions& options = {},
                                                std::shared_ptr<CommRecorder> recorder = nullptr);

/// Creates the world Communicator of a process launched by torchrun or shardlab-run: a TCPStore served by rank 0
/// at MASTER_ADDR:MASTER_PORT. When the group is NCCL, `hostname` is ignored and NCCL runs on the current GPU:
/// make it this rank's first, as with `torch.cuda.set_device(local_rank)` (device.h:
/// `set_current_device(device_for_rank(parse_device("cuda"), RankEnv::from_environment().local_rank))`).
std::shared_ptr<Communicator> communicator_from_env(const GroupOptions& options = {});

}  // namespace shardlab
