#include "options.h"

#include "../cli_validators.h"

#include "strategies.h"

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/device/device.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/numbers.h"
#include "shardlab/course/model_factory.h"

#include <CLI/CLI.hpp>

#include <unistd.h>

#include <filesystem>
#include <limits>
#include <set>
#include <stdexcept>

namespace shardlab::cli {

namespace fs = std::filesystem;

namespace {

// The floating dtypes FSDP's mixed precision takes ("" is not among them: leave the flag out instead).
const std::vector<std::string>& dtype_names() {
  static const std::vector<std::string> names{"float32", "bfloat16", "float16", "float64"};
  return names;
}

// "RxS" as Mesh::parse reads it, of at most 64 ranks (as --world-size).
CLI::Validator mesh_shape_of() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        int64_t ranks = 0;
        try {
          const auto [replicas, shards] = Mesh::parse(v);
          ranks = int64_t{replicas} * shards;
        } catch (const std::invalid_argument&) {
          return "expects replicas x shards as RxS with R, S >= 1 (e.g. 2x2); got '" + v + "'";
        }
        if (ranks > 64)
          return "expects at most 64 ranks (R x S), as --world-size; got '" + v + "', " + std::to_string(ranks) +
                 " ranks";
        return "";
      },
      "RxS");
}

CLI::Validator a_device() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        try {
          v = parse_device(v).str();
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
        return "";
      },
      "cpu|cuda|cuda:N");
}

bool on_off(const std::string& v) { return v == "on" || v == "true"; }

}  // namespace

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
  StrategyOptions& s = o.strategy_options;
  if (strategy)
    cmd.add_option("--strategy", o.strategy, "how the ranks train (Strategies, below)")
        ->check(one_of(strategy_names()))
        ->type_name("S");
  cmd.add_option("--world-size", o.world_size, "ranks (processes)")->transform(integer_in(1, 64))->type_name("N");
  cmd.add_option("--model", o.train.model, "the model")->check(one_of(model_names()))->type_name("M");
  cmd.add_option("--layers", o.train.layers, "transformer blocks of tiny_gpt")->transform(integer_in(1, 64));
  cmd.add_option("--dim", o.train.dim, "width of tiny_gpt (even)")->transform(integer_in(2, 4096));
  cmd.add_option("--steps", o.train.steps, "the step to train up to")->transform(integer_in(1, 100000))->type_name("K");
  cmd.add_option("--global-batch", o.train.global_batch, "examples per step over all ranks")
      ->transform(integer_in(1, 1 << 20))
      ->type_name("B");
  cmd.add_option("--seed", o.train.seed, "model and data seed")->transform(integer_in(0, int64_t{1} << 40));
  cmd.add_option("--optimizer", o.train.optimizer, "the optimizer")->check(one_of({"sgd", "adamw"}));
  cmd.add_option("--lr", o.train.lr, "learning rate")->check(positive_number());
  cmd.add_option("--micro-batches", o.train.micro_batches, "gradient accumulation per step")
      ->transform(integer_in(1, 1024));
  cmd.add_option("--clip-norm", o.train.clip_norm, "clip the gradients' global norm to X (not with overlap_optimizer)")
      ->check(positive_number())
      ->default_str("");  // off: not written by --write-config (0 is no bound)
  cmd.add_option_function<std::string>(
         "--clip-norm-type",
         [&o](const std::string& v) { o.train.clip_p = v == "inf" ? std::numeric_limits<double>::infinity() : 2.0; },
         "the norm --clip-norm bounds")
      ->check(one_of({"2", "inf"}))
      ->default_str("2");
  // The checkpoints are train's: compare and bench keep the flags only to refuse them in words (check_run_options),
  // and do not show them.
  const std::string checkpoints_group = strategy ? "Options" : "";
  cmd.add_option("--save", o.save_dir,
                 "a checkpoint in DIR after the last step (model, optimizer, step; any world size and strategy "
                 "loads it; docs/checkpoints.md)")
      ->type_name("DIR")
      ->group(checkpoints_group);
  cmd.add_option("--save-every", o.save_every, "also after every K-th step, replacing it atomically")
      ->transform(integer_in(1, 100000))
      ->default_str("")  // off: only after the last step
      ->group(checkpoints_group);
  cmd.add_option("--resume", o.resume_dir,
                 "start from the checkpoint in DIR, at its step, up to --steps (or from a .safetensors file of "
                 "weights: step 0, a fresh optimizer)")
      ->type_name("DIR")
      ->group(checkpoints_group);
  cmd.add_option_function<std::vector<std::string>>(
         "--bucket-cap-kb",
         [&s](const std::vector<std::string>& values) {
           for (const auto& v : values) {
             if (v == "auto")
               s.auto_caps = true;
             else
               s.bucket_cap_bytes = *parse_integer(v, 1, 1 << 22) * 1024;
           }
         },
         "bucket cap after the first bucket, in KiB (25600); auto: both caps chosen after step 2 from measured "
         "all-reduce costs and gradient-ready times, starting from the caps given before it (--bucket-cap-kb 32 "
         "--bucket-cap-kb auto)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            if (v == "auto" || parse_integer(v, 1, 1 << 22)) return "";
            return "expects an integer in [1, 4194304] or auto; got '" + v + "'";
          },
          "N|auto"))
      ->type_name("N|auto")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd.add_option_function<int64_t>(
         "--first-bucket-kb", [&s](int64_t kb) { s.first_bucket_cap_bytes = kb * 1024; },
         "cap of the first bucket, in KiB")
      ->transform(integer_in(1, 1 << 22))
      ->default_str("1024");
  cmd.add_option_function<std::string>(
         "--reshard-after-forward", [&s](const std::string& v) { s.reshard_after_forward = v == "true"; },
         "FSDP: free units after forward")
      ->check(one_of({"true", "false"}))
      ->default_str("true");
  cmd.add_option("--param-dtype", s.param_dtype, "FSDP: gather/compute dtype (default: the parameters')")
      ->check(one_of(dtype_names()));
  cmd.add_option("--reduce-dtype", s.reduce_dtype, "FSDP: reduce-scatter dtype (default: the param dtype)")
      ->check(one_of(dtype_names()));
  cmd.add_option("--prefetch-depth", s.prefetch_depth,
                 "fsdp_prefetch, hsdp: units whose all-gather is issued ahead, in forward and in backward (0: none)")
      ->transform(integer_in(0, 64));
  cmd.add_option("--prefetch-limit", s.prefetch_limit, "fsdp_prefetch, hsdp: most units ahead at once (0: the depth)")
      ->transform(integer_in(0, 64));
  cmd.add_option(
         "--mesh", s.mesh,
         "hsdp: R replicas of S >= 2 shards (sets the world size to R*S; default 2x(N/2) for an even world size "
         "N >= 4, else 1xN)")
      ->check(mesh_shape_of());
  cmd.add_option_function<std::string>(
         "--defer-all-reduce", [&s](const std::string& v) { s.defer_all_reduce = v == "true"; },
         "hsdp with --micro-batches > 1: reduce-scatter every micro-batch and all-reduce across replicas once "
         "(false: no_sync)")
      ->check(one_of({"true", "false"}))
      ->default_str("false");
  cmd.add_option("--cpu-allocator", o.cpu_allocator, "every CPU tensor of 1 MiB or more from a reusing pool")
      ->check(one_of({"system", "pool"}));
  cmd.add_option("--memory-limit-mib", o.memory_limit_mib,
                 "each rank's data memory in MiB (RLIMIT_DATA: heap, tensors, stacks); an allocation beyond it fails "
                 "with an out-of-memory error naming the limit (0: none)")
      ->transform(integer_in(0, 1 << 24));
  cmd.add_option_function<std::string>(
         "--pool-buffers", [&s](const std::string& v) { s.pool_buffers = v == "true"; },
         "FSDP: reuse the units' buffers (false: malloc/free each time)")
      ->check(one_of({"true", "false"}))
      ->default_str("true");
  cmd.add_option("--threads", o.threads,
                 "compute threads per rank, libtorch's and OpenBLAS's (0: OMP_NUM_THREADS, which the launcher sets "
                 "to 1 when unset)")
      ->transform(integer_in(0, 256));
  cmd.add_option("--device", o.train.device, "cuda = GPU LOCAL_RANK")->transform(a_device());
  cmd.add_option("--backend", o.backend, "nccl needs --device cuda")->check(one_of({"gloo", "nccl"}));
  cmd.add_option_function<std::string>(
         "--comm-yield", [&o](const std::string& v) { o.comm_yield = on_off(v); },
         "backward yields its core at each gradient while a collective is in flight, so Gloo's threads move it "
         "(Note [Yielding to communication])")
      ->check(one_of({"on", "off"}))
      ->default_str("on");
  cmd.add_option("--trace", o.trace_dir, "write DIR/rankR.trace.json (Chrome trace: chrome://tracing, ui.perfetto.dev)")
      ->type_name("DIR");
  cmd.add_option("--reference", o.reference,
                 "single: train the whole model on one device in this process too and compare every rank with it; "
                 "none: the ranks alone, for a model whose training one machine cannot hold (no comparison, no final "
                 "loss)")
      ->check(one_of({"single", "none"}))
      ->group(checkpoints_group);  // train's (and its worker's) only, as the checkpoints
  cmd.add_option("--json", o.json, "also write the report as JSON")->check(file_to_write("a file to write"));
  cmd.add_option("--timeout", o.timeout_s, "kill the run if it takes longer, in seconds")
      ->transform(integer_in(1, 86400));
  if (worker) cmd.add_option("--result-dir", o.result_dir, "where this rank writes its results")->required();
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
  for (const char* flag : {"--mesh", "--defer-all-reduce"}) {
    if (allow_strategy && !can.mesh && given(flag))
      throw std::invalid_argument(std::string(flag) + " applies to strategy " + strategies_that(&Capabilities::mesh) +
                                  " only; got strategy '" + o.strategy + "'");
  }
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
  for (const char* flag : {"--prefetch-depth", "--prefetch-limit"}) {
    if (allow_strategy && !can.prefetches && given(flag))
      throw std::invalid_argument(std::string(flag) + " sets the prefetch of strategies " +
                                  strategies_that(&Capabilities::prefetches) + "; got strategy '" + o.strategy + "'");
  }
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
