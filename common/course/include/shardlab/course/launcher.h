#pragma once
/// @file launcher.h
/// Starts N local processes the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
/// MASTER_ADDR, MASTER_PORT in their environment; with several nodes, one launcher per machine, each starting its
/// node's ranks of the whole world, as torchrun's --nnodes / --node-rank), forwards their output line by line tagged
/// with the rank, and fails fast: when one rank exits non-zero or the whole job runs past its timeout, the others are
/// killed and the result names the rank. SIGINT or SIGTERM to the launcher while it runs stops every rank the same way
/// (exit code 128 + signal, failed_rank -1) instead of leaving them running. Used by `shardlab-run` and `shardlab
/// train`. As torchrun does, every rank gets OMP_NUM_THREADS=1 unless the launcher's environment or extra_env sets it
/// (see Note [BLAS threads per rank] in blas.h).

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

/// What to launch and how long to wait.
struct LaunchOptions {
  int nproc = 1;      ///< number of ranks (processes) on this node, >= 1
  int nnodes = 1;     ///< number of nodes (machines), each running its own launcher with the same nproc
  int node_rank = 0;  ///< this node's index in [0, nnodes): its ranks are node_rank * nproc + 0 .. nproc - 1
  std::string master_addr = "127.0.0.1";                       ///< MASTER_ADDR given to every rank
  int master_port = 0;                                         ///< MASTER_PORT; 0 = pick a free port
  std::chrono::milliseconds timeout{600'000};                  ///< wall-clock limit for the whole job
  std::vector<std::pair<std::string, std::string>> extra_env;  ///< more variables for every rank
};

/// How a launch ended.
struct LaunchResult {
  int exit_code = 0;     ///< 0 when every rank exited 0; else the failing rank's code: 128 + signal if it was
                         ///< killed, 127 if the program cannot be executed, 124 on timeout
  int failed_rank = -1;  ///< first rank that failed or hung, -1 when all succeeded
  std::string message;   ///< human-readable reason, e.g. "rank 2 exited with code 1"
};

/// Receives each line a rank writes to stdout or stderr (without the newline).
using LineSink = std::function<void(int rank, const std::string& line)>;

/// The default sink: writes "[rank R] line" to stdout.
void print_prefixed(int rank, const std::string& line);

/// Returns a TCP port on 127.0.0.1 that was free a moment ago.
int pick_free_port();

/// Runs `argv` (argv[0] looked up on PATH) as options.nproc processes (this node's ranks) and waits for all of
/// them. The sink and the result name global ranks. A failure on another node reaches this one as its ranks' own
/// failure (their collectives time out or see the connection close), not by itself. Blocks; calls
/// `sink` on the calling thread, stdout and stderr of a rank merged, a partial last line flushed at EOF.
/// Each rank runs in its own process group with stdin from /dev/null; when a rank exits, anything it left running
/// in its group is killed. When a rank fails or the timeout passes, the other ranks get SIGTERM, then SIGKILL
/// 3 s later; launch() returns once every rank has been reaped. An exception from `sink` kills and reaps all ranks
/// before it propagates.
/// @throws std::invalid_argument when nproc < 1, argv is empty, master_port is outside 0..65535, timeout <= 0,
///         node_rank is outside [0, nnodes), or nnodes > 1 with master_port 0.
/// @throws std::system_error when a pipe or a process cannot be created.
LaunchResult launch(const LaunchOptions& options, const std::vector<std::string>& argv,
                    const LineSink& sink = print_prefixed);

}  // namespace shardlab
