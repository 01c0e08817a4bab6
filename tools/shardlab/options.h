#pragma once
// Command-line options of `shardlab train`, `shardlab compare` and the hidden `shardlab worker`.

#include "shardlab/common/reference.h"

#include <string>
#include <vector>

namespace shardlab::cli {

/// Everything one run needs; filled from flags by parse_options.
struct RunOptions {
  std::string strategy = "naive_ddp";  ///< see strategy_names()
  int world_size = 2;                  ///< ranks (processes)
  TrainConfig train;                   ///< model, optimizer, steps, batch, seed, micro-batches
  std::string json;                    ///< --json FILE: write the report there ("" = none)
  std::string result_dir;              ///< worker only: where to write this rank's results
  int timeout_s = 600;                 ///< the launcher kills a job that runs longer
};

/// Parses `args` (without the subcommand). `allow_strategy` is false for compare (it runs them all).
/// @throws std::invalid_argument naming the flag, what was expected and what came.
RunOptions parse_options(const std::vector<std::string>& args, bool allow_strategy);

/// The flags as a worker command line (inverse of parse_options).
std::vector<std::string> to_args(const RunOptions& o);

/// Usage text for `shardlab --help`.
std::string usage();

}  // namespace shardlab::cli
