// The run options written out (options.h): as a worker's command line (to_args) and as the TOML a config file holds
// (config_toml), which CLI11 writes from that command line, so both say the same options.
#include "options.h"

#include "strategies.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab::cli {
namespace {

// `app`'s subcommand "train" with the run options, bound to `o`: the table a config file's keys are read from.
CLI::App* add_run_options_command(CLI::App& app, RunOptions& o) {
  CLI::App* train = app.add_subcommand("train");
  add_run_options(*train, o, /*strategy=*/true);
  return train;
}

}  // namespace

std::string config_toml(const RunOptions& o) {
  // to_args is complete by construction (a worker runs on it alone): every option in force, derived ones included
  // (the world size a mesh sets). Parsed as train's command line, CLI11 writes exactly those options in its own
  // TOML (a flag given twice, --bucket-cap-kb 32 --bucket-cap-kb auto, is an array), and reads it back.
  std::vector<std::string> args = to_args(o);
  const auto dir = std::find(args.begin(), args.end(), "--result-dir");  // the worker's, not the run's
  if (dir != args.end()) args.erase(dir, dir + 2);
  args.insert(args.end(), {"--timeout", std::to_string(o.timeout_s)});
  args.insert(args.begin(), "train");
  CLI::App app{"", "shardlab"};
  RunOptions parsed = default_run_options();
  add_run_options_command(app, parsed);
  std::reverse(args.begin(), args.end());  // CLI11 takes a vector last argument first
  app.parse(args);
  return app.config_to_str(/*default_also=*/false, /*write_description=*/false);
}

RunOptions read_config_file(const std::string& path) {
  CLI::App app{"", "shardlab"};
  app.allow_config_extras(CLI::config_extras_mode::error);  // as train's: a key no option takes is refused
  RunOptions o = default_run_options();
  CLI::App* train = add_run_options_command(app, o);
  app.set_config("--config");
  train->fallthrough();
  app.parse(std::vector<std::string>{path, "--config", "train"});  // CLI11 takes a vector last argument first
  return o;
}

void check_config_writable(const RunOptions& o) {
  const std::vector<std::string> args = to_args(o);
  for (size_t i = 0; i + 1 < args.size(); i += 2)
    if (args[i + 1].find_first_of("#\\\n\"'") != std::string::npos)
      throw std::invalid_argument("--write-config cannot write " + args[i] + " '" + args[i + 1] +
                                  "': a config file's value may not hold '#', '\\', a quote or a line break (CLI11 2.1 "
                                  "reads them back wrongly); choose another");
}

std::vector<std::string> to_args(const RunOptions& o) {
  std::ostringstream lr;
  lr.precision(17);
  lr << o.train.lr;
  std::vector<std::string> args{"--strategy",
                                o.strategy,
                                "--world-size",
                                std::to_string(o.world_size),
                                "--model",
                                o.train.model,
                                "--steps",
                                std::to_string(o.train.steps),
                                "--global-batch",
                                std::to_string(o.train.global_batch),
                                "--seed",
                                std::to_string(o.train.seed),
                                "--optimizer",
                                o.train.optimizer,
                                "--lr",
                                lr.str(),
                                "--micro-batches",
                                std::to_string(o.train.micro_batches),
                                "--result-dir",
                                o.result_dir,
                                "--bucket-cap-kb",
                                std::to_string(o.strategy_options.bucket_cap_bytes / 1024),
                                "--first-bucket-kb",
                                std::to_string(o.strategy_options.first_bucket_cap_bytes / 1024),
                                "--threads",
                                std::to_string(o.threads),
                                "--device",
                                o.train.device,
                                "--backend",
                                o.backend,
                                "--comm-yield",
                                o.comm_yield ? "on" : "off",
                                "--cpu-allocator",
                                o.cpu_allocator,
                                "--memory-limit-mib",
                                std::to_string(o.memory_limit_mib),
                                "--layers",
                                std::to_string(o.train.layers),
                                "--dim",
                                std::to_string(o.train.dim),
                                "--reshard-after-forward",
                                o.strategy_options.reshard_after_forward ? "true" : "false",
                                "--pool-buffers",
                                o.strategy_options.pool_buffers ? "true" : "false",
                                "--reference",
                                o.reference};
  const Capabilities can = capabilities_of(o.strategy);
  if (can.prefetches) {  // only there: the worker refuses them for other strategies, as train does
    args.insert(args.end(), {"--prefetch-depth", std::to_string(o.strategy_options.prefetch_depth), "--prefetch-limit",
                             std::to_string(o.strategy_options.prefetch_limit)});
  }
  if (can.mesh) {
    const auto [replicas, shards] = mesh_shape(o.strategy_options, o.world_size);
    args.insert(args.end(), {"--mesh", std::to_string(replicas) + "x" + std::to_string(shards), "--defer-all-reduce",
                             o.strategy_options.defer_all_reduce ? "true" : "false"});
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, std::string>{"--param-dtype", o.strategy_options.param_dtype},
        {"--reduce-dtype", o.strategy_options.reduce_dtype}}) {
    if (value.empty()) continue;
    args.push_back(flag);
    args.push_back(value);
  }
  // After the cap itself, which stays the cap auto starts from (CLI11 keeps a repeated flag's values in order).
  if (o.strategy_options.auto_caps && can.buckets) {
    args.push_back("--bucket-cap-kb");
    args.push_back("auto");
  }
  if (o.train.clip_norm > 0) {
    std::ostringstream bound;
    bound.precision(17);
    bound << o.train.clip_norm;
    args.insert(args.end(), {"--clip-norm", bound.str(), "--clip-norm-type", std::isinf(o.train.clip_p) ? "inf" : "2"});
  }
  if (!o.trace_dir.empty()) {
    args.push_back("--trace");
    args.push_back(o.trace_dir);
  }
  if (!o.save_dir.empty()) args.insert(args.end(), {"--save", o.save_dir});
  if (o.save_every > 0) args.insert(args.end(), {"--save-every", std::to_string(o.save_every)});
  if (!o.resume_dir.empty()) args.insert(args.end(), {"--resume", o.resume_dir});
  return args;
}

}  // namespace shardlab::cli
