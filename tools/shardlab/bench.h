#pragma once
// `shardlab bench`: every DDP strategy of the course and PyTorch's own DDP on the same model, world size, batch
// and steps, side by side in one run, with the ratios. Figures, not assertions: nothing here is a test.

#include <string>
#include <vector>

namespace shardlab::cli {

/// Body of `shardlab bench ARGS`: prints the table; with --out PREFIX also writes PREFIX.json and PREFIX.md.
/// @throws std::invalid_argument on a bad flag.
int run_bench(const std::vector<std::string>& args, const std::string& self_exe);

}  // namespace shardlab::cli
