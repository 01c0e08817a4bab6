#include "options.h"

#include "../cli_validators.h"

#include "option_table.h"
#include "strategies.h"

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/device/device.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/numbers.h"

#include <CLI/CLI.hpp>

#include <unistd.h>

#include <filesystem>
#include <set>
#include <stdexcept>

namespace shardlab::cli {

namespace fs = std::filesystem;

RunOptions default_run_options() {
  RunOptions o;
  o.train.model = "mlp";
  o.train.steps = 10;
  o.train.global_batch = 16;
  return o;
}

void add_run_options(CLI::App& cmd, RunOptions& o, bool strategy, bool worker) {
  // A flag given twice: the last one, as before CLI11 (and as argparse); --bucket-cap-kb keeps every value.
  cmd.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  using Where = RunOption::Where;
  for (const RunOption& option : run_option_table()) {
    if ((option.where == Where::kStrategy && !strategy) || (option.where == Where::kWorker && !worker)) continue;
    CLI::Option* added = option.add(cmd, o);
    if (option.where == Where::kTrain && !strategy) added->group("");  // compare, bench: kept to refuse, not shown
  }
}

std::string checkpoint_problem(const std::string& path, bool weights_file) {
  std::error_code ec;
  const fs::path p(path);
  if (fs::exists(path + ".shardlab-old", ec)) return "";  // the previous checkpoint, kept while a save replaced it
  if (!fs::exists(p, ec)) return "which does not exist";
  if (fs::is_directory(p, ec)) return fs::exists(p / "index.json", ec) ? "" : "a directory without index.json";
  if (!weights_file) return "a file, not a directory";
  return p.extension() == ".safetensors" ? "" : "a file that is not .safetensors";
}

std::set<std::string> given_flags(const CLI::App& cmd) {
  std::set<std::string> given;
  for (const CLI::Option* opt : cmd.get_options())
    if (opt->count() > 0 && !opt->get_lnames().empty()) given.insert("--" + opt->get_lnames().front());
  return given;
}

RunOptions check_run_options(const std::set<std::string>& typed, RunOptions o, bool allow_strategy) {
  const auto given = [&typed](const char* flag) { return typed.count(flag) > 0; };
  // A mesh from --config gives way to a typed --world-size or --strategy (the flag wins).
  const Capabilities can = capabilities_of(o.strategy);
  if (!given("--mesh") && (given("--world-size") || (allow_strategy && !can.mesh))) o.strategy_options.mesh.clear();
  if (!o.strategy_options.mesh.empty()) {  // the mesh says how many ranks; --world-size may only agree with it
    const auto [replicas, shards] = Mesh::parse(o.strategy_options.mesh);
    if (given("--world-size") && o.world_size != replicas * shards)
      throw std::invalid_argument("--mesh " + o.strategy_options.mesh + " has " + std::to_string(replicas * shards) +
                                  " ranks; got --world-size " + std::to_string(o.world_size) +
                                  " (drop --world-size or make them agree)");
    o.world_size = replicas * shards;
  }
  for (const RunOption& option : run_option_table())  // a flag of what this strategy cannot do
    if (allow_strategy && option.needs != nullptr && !(can.*option.needs) && given(option.flag.c_str()))
      throw std::invalid_argument(refusal_of(option, o.strategy));
  const bool one_rank = !can.communicates;
  const int world = one_rank ? 1 : o.world_size;
  if (one_rank && allow_strategy && o.world_size != 1 && given("--world-size"))
    throw std::invalid_argument("--strategy " + o.strategy + " runs on one rank; got --world-size " +
                                std::to_string(o.world_size) + " (drop the flag or pass 1)");
  if (one_rank) o.world_size = 1;
  if (allow_strategy && can.shards) {  // built by parallelize: a mesh of shard size 1 would be DDP, not this strategy
    const auto [replicas, shards] = find_strategy(o.strategy).mesh(o.strategy_options, world);
    if (shards < 2)
      throw std::invalid_argument("--strategy " + o.strategy + " shards over S >= 2 ranks per replica; got a " +
                                  std::to_string(replicas) + "x" + std::to_string(shards) +
                                  (replicas == 1 ? " mesh (one rank: --strategy single)"
                                                 : " mesh (a mesh of shard size 1 is DDP: --strategy bucketed_ddp)"));
  }
  if (o.backend == "nccl" && !parse_device(o.train.device).is_cuda())
    throw std::invalid_argument("--backend nccl moves CUDA tensors only; it needs --device cuda, got --device " +
                                o.train.device);
  if (o.backend == "nccl" && parse_device(o.train.device).has_index() && world > 1)
    throw std::invalid_argument("--backend nccl needs one GPU per rank; got --device " + o.train.device + " for " +
                                std::to_string(world) + " ranks (use --device cuda: rank r on GPU r)");
  if (o.train.dim % 2 != 0)
    throw std::invalid_argument("--dim expects an even width (tiny_gpt has 2 heads); got " +
                                std::to_string(o.train.dim));
  if (o.train.global_batch % (static_cast<int64_t>(world) * o.train.micro_batches) != 0)
    throw std::invalid_argument(
        "--global-batch " + std::to_string(o.train.global_batch) +
        " must divide by world size x micro-batches = " + std::to_string(world * o.train.micro_batches));
  if (o.strategy_options.auto_caps && allow_strategy && !can.buckets && given("--bucket-cap-kb"))
    throw std::invalid_argument("--bucket-cap-kb auto tunes the buckets of " + strategies_that(&Capabilities::buckets) +
                                "; got strategy '" + o.strategy + "', which has none");
  if (allow_strategy && !can.clips() && o.train.clip_norm > 0)
    throw std::invalid_argument("--clip-norm needs the whole gradient before any parameter steps; strategy " +
                                o.strategy +
                                " steps each bucket's parameters inside backward, as its average lands (use "
                                "bucketed_ddp)");
  if (!allow_strategy && (!o.save_dir.empty() || !o.resume_dir.empty() || o.save_every > 0))
    throw std::invalid_argument(
        "--save, --save-every and --resume are options of shardlab train (compare runs every "
        "strategy, which would all write one checkpoint)");
  if (!allow_strategy && o.reference == "none")
    throw std::invalid_argument(
        "--reference none trains without one device; compare and bench set every strategy beside one device (use "
        "shardlab train --reference none)");
  if (o.save_every > 0 && o.save_dir.empty())
    throw std::invalid_argument("--save-every K saves every K steps into --save DIR; got it without --save");
  if (allow_strategy && !can.checkpoints() && (!o.save_dir.empty() || !o.resume_dir.empty()))
    throw std::invalid_argument("--save and --resume save and load the optimizer's state; strategy " + o.strategy +
                                " keeps one optimizer per parameter inside its reducer, which a checkpoint cannot "
                                "name (use bucketed_ddp)");
  if (!o.save_dir.empty()) {  // checked now, not after the whole training
    std::error_code ec;
    const fs::path dir(o.save_dir);
    const fs::path parent = fs::absolute(dir).parent_path();
    if (fs::exists(dir, ec) &&
        (!fs::is_directory(dir, ec) || (!fs::exists(dir / "index.json", ec) && !fs::is_empty(dir, ec))))
      throw std::invalid_argument(
          "--save expects a new or empty directory, or a checkpoint to replace; got '" + o.save_dir + "', which is " +
          (fs::is_directory(dir, ec) ? "a directory with other files (no index.json)" : "not a directory"));
    if (const std::string file = file_in_the_way(o.save_dir); !file.empty())
      throw std::invalid_argument("--save expects a directory to make; got '" + o.save_dir + "' ('" + file +
                                  "' is a file, not a directory)");
    if (fs::is_directory(parent, ec) && access(parent.c_str(), W_OK) != 0)
      throw std::invalid_argument("--save expects a directory it can write beside; got '" + o.save_dir + "' ('" +
                                  parent.string() + "' is not writable)");
  }
  if (!o.resume_dir.empty()) {
    const std::string problem = checkpoint_problem(o.resume_dir, /*weights_file=*/true);
    if (!problem.empty())
      throw std::invalid_argument(
          "--resume expects a checkpoint (a directory from --save, or a .safetensors file); "
          "got '" +
          o.resume_dir + "', " + problem);
  }
  if (!o.trace_dir.empty()) {
    std::error_code ec;
    if (fs::exists(o.trace_dir, ec) && !fs::is_directory(o.trace_dir, ec))
      throw std::invalid_argument("--trace expects a directory; got '" + o.trace_dir + "', which is a file");
  }
  if (given("--clip-norm-type") && !(o.train.clip_norm > 0))
    throw std::invalid_argument("--clip-norm-type chooses the norm --clip-norm bounds; got it without --clip-norm");
  return o;
}

RunOptions parse_run_args(const std::vector<std::string>& args, RunOptions defaults, bool allow_strategy) {
  CLI::App cmd{"", "shardlab"};
  add_run_options(cmd, defaults, allow_strategy);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes a vector last argument first
  try {
    cmd.parse(reversed);
  } catch (const CLI::ParseError& e) {
    throw std::invalid_argument(e.what());
  }
  return check_run_options(given_flags(cmd), defaults, allow_strategy);
}

}  // namespace shardlab::cli
