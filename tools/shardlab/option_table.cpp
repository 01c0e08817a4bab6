// The run options, declared once (option_table.h): each one's flag, its registration with CLI11 bound to its field,
// the words it is written back as, and the capability a strategy needs to take it. add_run_options, to_args (and
// from it config_toml) and check_run_options's refusals all read this table.
#include "option_table.h"

#include "../cli_validators.h"

#include "strategies.h"

#include "shardlab/core/comm/world.h"
#include "shardlab/core/device/device.h"
#include "shardlab/core/errors.h"
#include "shardlab/course/model_factory.h"

#include <CLI/CLI.hpp>

#include <cmath>
#include <limits>
#include <sstream>

namespace shardlab::cli {
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

// A number as the worker must read it back: every digit a double has.
std::string exact(double v) {
  std::ostringstream out;
  out.precision(17);
  out << v;
  return out.str();
}

using Values = std::vector<std::string>;
Values one(std::string v) { return {std::move(v)}; }
Values one(int64_t v) { return {std::to_string(v)}; }
Values unless_empty(const std::string& v) { return v.empty() ? Values{} : Values{v}; }
const char* truth(bool b) { return b ? "true" : "false"; }

// A flag that takes true or false into `field` (its default shown as `shown`).
CLI::Option* true_false(CLI::App& cmd, const std::string& flag, bool& field, const std::string& help,
                        const char* shown) {
  return cmd
      .add_option_function<std::string>(
          flag, [&field](const std::string& v) { field = v == "true"; }, help)
      ->check(one_of({"true", "false"}))
      ->default_str(shown);
}

}  // namespace

const std::vector<RunOption>& run_option_table() {
  using W = RunOption::Where;
  using Out = RunOption::Written;
  // In the order --help lists them. Each `add` gives its validator, which names what it expects and what came.
  static const std::vector<RunOption> table{
      {"--strategy", W::kStrategy, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--strategy", o.strategy, "how the ranks train (Strategies, below)")
             ->check(one_of(strategy_names()))
             ->type_name("S");
       },
       [](const RunOptions& o) { return one(o.strategy); }},
      {"--world-size", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--world-size", o.world_size, "ranks (processes)")
             ->transform(integer_in(1, 64))
             ->type_name("N");
       },
       [](const RunOptions& o) { return one(o.world_size); }},
      {"--model", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--model", o.train.model, "the model")->check(one_of(model_names()))->type_name("M");
       },
       [](const RunOptions& o) { return one(o.train.model); }},
      {"--layers", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--layers", o.train.layers, "transformer blocks of tiny_gpt")
             ->transform(integer_in(1, 64));
       },
       [](const RunOptions& o) { return one(o.train.layers); }},
      {"--dim", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--dim", o.train.dim, "width of tiny_gpt (even)")->transform(integer_in(2, 4096));
       },
       [](const RunOptions& o) { return one(o.train.dim); }},
      {"--steps", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--steps", o.train.steps, "the step to train up to")
             ->transform(integer_in(1, 100000))
             ->type_name("K");
       },
       [](const RunOptions& o) { return one(o.train.steps); }},
      {"--global-batch", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--global-batch", o.train.global_batch, "examples per step over all ranks")
             ->transform(integer_in(1, 1 << 20))
             ->type_name("B");
       },
       [](const RunOptions& o) { return one(o.train.global_batch); }},
      {"--seed", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--seed", o.train.seed, "model and data seed")
             ->transform(integer_in(0, int64_t{1} << 40));
       },
       [](const RunOptions& o) { return one(static_cast<int64_t>(o.train.seed)); }},
      {"--optimizer", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--optimizer", o.train.optimizer, "the optimizer")->check(one_of({"sgd", "adamw"}));
       },
       [](const RunOptions& o) { return one(o.train.optimizer); }},
      {"--lr", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--lr", o.train.lr, "learning rate")->check(positive_number());
       },
       [](const RunOptions& o) { return one(exact(o.train.lr)); }},
      {"--micro-batches", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--micro-batches", o.train.micro_batches, "gradient accumulation per step")
             ->transform(integer_in(1, 1024));
       },
       [](const RunOptions& o) { return one(o.train.micro_batches); }},
      {"--clip-norm", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--clip-norm", o.train.clip_norm,
                         "clip the gradients' global norm to X (not with overlap_optimizer)")
             ->check(positive_number())
             ->default_str("");  // off: not written by --write-config (0 is no bound)
       },
       [](const RunOptions& o) { return o.train.clip_norm > 0 ? one(exact(o.train.clip_norm)) : Values{}; }},
      {"--clip-norm-type", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option_function<std::string>(
                 "--clip-norm-type",
                 [&o](const std::string& v) {
                   o.train.clip_p = v == "inf" ? std::numeric_limits<double>::infinity() : 2.0;
                 },
                 "the norm --clip-norm bounds")
             ->check(one_of({"2", "inf"}))
             ->default_str("2");
       },
       [](const RunOptions& o) {
         return o.train.clip_norm > 0 ? one(std::isinf(o.train.clip_p) ? "inf" : "2") : Values{};
       }},
      // The checkpoints are train's: compare and bench keep the flags only to refuse them in words
      // (check_run_options), and do not show them.
      {"--save", W::kTrain, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--save", o.save_dir,
                         "a checkpoint in DIR after the last step (model, optimizer, step; any world size and "
                         "strategy loads it; docs/checkpoints.md)")
             ->type_name("DIR");
       },
       [](const RunOptions& o) { return unless_empty(o.save_dir); }},
      {"--save-every", W::kTrain, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--save-every", o.save_every, "also after every K-th step, replacing it atomically")
             ->transform(integer_in(1, 100000))
             ->default_str("");  // off: only after the last step
       },
       [](const RunOptions& o) { return o.save_every > 0 ? one(o.save_every) : Values{}; }},
      {"--resume", W::kTrain, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--resume", o.resume_dir,
                         "start from the checkpoint in DIR, at its step, up to --steps (or from a .safetensors file "
                         "of weights: step 0, a fresh optimizer)")
             ->type_name("DIR");
       },
       [](const RunOptions& o) { return unless_empty(o.resume_dir); }},
      {"--bucket-cap-kb", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         StrategyOptions& s = o.strategy_options;
         return cmd
             .add_option_function<std::vector<std::string>>(
                 "--bucket-cap-kb",
                 [&s](const std::vector<std::string>& values) {
                   for (const auto& v : values) {
                     if (v == "auto")
                       s.auto_caps = true;
                     else
                       s.bucket_cap_bytes = *parse_integer(v, 1, 1 << 22) * 1024;
                   }
                 },
                 "bucket cap after the first bucket, in KiB (25600); auto: both caps chosen after step 2 from "
                 "measured all-reduce costs and gradient-ready times, starting from the caps given before it "
                 "(--bucket-cap-kb 32 --bucket-cap-kb auto)")
             ->check(CLI::Validator(
                 [](std::string& v) -> std::string {
                   if (v == "auto" || parse_integer(v, 1, 1 << 22)) return "";
                   return "expects an integer in [1, 4194304] or auto; got '" + v + "'";
                 },
                 "N|auto"))
             ->type_name("N|auto")
             ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
       },
       // The cap, then auto after it (CLI11 keeps a repeated flag's values in order): the cap is where auto starts.
       [](const RunOptions& o) {
         Values v{std::to_string(o.strategy_options.bucket_cap_bytes / 1024)};
         if (o.strategy_options.auto_caps && capabilities_of(o.strategy).buckets) v.emplace_back("auto");
         return v;
       }},
      {"--first-bucket-kb", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         StrategyOptions& s = o.strategy_options;
         return cmd
             .add_option_function<int64_t>(
                 "--first-bucket-kb", [&s](int64_t kb) { s.first_bucket_cap_bytes = kb * 1024; },
                 "cap of the first bucket, in KiB")
             ->transform(integer_in(1, 1 << 22))
             ->default_str("1024");
       },
       [](const RunOptions& o) { return one(o.strategy_options.first_bucket_cap_bytes / 1024); }},
      {"--reshard-after-forward", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return true_false(cmd, "--reshard-after-forward", o.strategy_options.reshard_after_forward,
                           "FSDP: free units after forward", "true");
       },
       [](const RunOptions& o) { return one(truth(o.strategy_options.reshard_after_forward)); }},
      {"--param-dtype", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--param-dtype", o.strategy_options.param_dtype,
                         "FSDP: gather/compute dtype (default: the parameters')")
             ->check(one_of(dtype_names()));
       },
       [](const RunOptions& o) { return unless_empty(o.strategy_options.param_dtype); }},
      {"--reduce-dtype", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--reduce-dtype", o.strategy_options.reduce_dtype,
                         "FSDP: reduce-scatter dtype (default: the param dtype)")
             ->check(one_of(dtype_names()));
       },
       [](const RunOptions& o) { return unless_empty(o.strategy_options.reduce_dtype); }},
      {"--prefetch-depth", W::kEveryCommand, Out::kEverywhere, &Capabilities::prefetches,
       "sets the prefetch of strategies {}",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--prefetch-depth", o.strategy_options.prefetch_depth,
                         "fsdp_prefetch, hsdp: units whose all-gather is issued ahead, in forward and in backward "
                         "(0: none)")
             ->transform(integer_in(0, 64));
       },
       [](const RunOptions& o) { return one(o.strategy_options.prefetch_depth); }},
      {"--prefetch-limit", W::kEveryCommand, Out::kEverywhere, &Capabilities::prefetches,
       "sets the prefetch of strategies {}",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--prefetch-limit", o.strategy_options.prefetch_limit,
                         "fsdp_prefetch, hsdp: most units ahead at once (0: the depth)")
             ->transform(integer_in(0, 64));
       },
       [](const RunOptions& o) { return one(o.strategy_options.prefetch_limit); }},
      {"--mesh", W::kEveryCommand, Out::kEverywhere, &Capabilities::mesh, "applies to strategy {} only",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--mesh", o.strategy_options.mesh,
                         "hsdp: R replicas of S >= 2 shards (sets the world size to R*S; default 2x(N/2) for an even "
                         "world size N >= 4, else 1xN)")
             ->check(mesh_shape_of());
       },
       // The mesh in force (the default one derived from the world size too): a worker takes it as given.
       [](const RunOptions& o) {
         const auto [replicas, shards] = mesh_shape(o.strategy_options, o.world_size);
         return one(std::to_string(replicas) + "x" + std::to_string(shards));
       }},
      {"--defer-all-reduce", W::kEveryCommand, Out::kEverywhere, &Capabilities::mesh, "applies to strategy {} only",
       [](CLI::App& cmd, RunOptions& o) {
         return true_false(
             cmd, "--defer-all-reduce", o.strategy_options.defer_all_reduce,
             "hsdp with --micro-batches > 1: reduce-scatter every micro-batch and all-reduce across replicas "
             "once (false: no_sync)",
             "false");
       },
       [](const RunOptions& o) { return one(truth(o.strategy_options.defer_all_reduce)); }},
      {"--cpu-allocator", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--cpu-allocator", o.cpu_allocator, "every CPU tensor of 1 MiB or more from a reusing pool")
             ->check(one_of({"system", "pool"}));
       },
       [](const RunOptions& o) { return one(o.cpu_allocator); }},
      {"--memory-limit-mib", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--memory-limit-mib", o.memory_limit_mib,
                         "each rank's data memory in MiB (RLIMIT_DATA: heap, tensors, stacks); an allocation beyond it "
                         "fails with an out-of-memory error naming the limit (0: none)")
             ->transform(integer_in(0, 1 << 24));
       },
       [](const RunOptions& o) { return one(o.memory_limit_mib); }},
      {"--pool-buffers", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return true_false(cmd, "--pool-buffers", o.strategy_options.pool_buffers,
                           "FSDP: reuse the units' buffers (false: malloc/free each time)", "true");
       },
       [](const RunOptions& o) { return one(truth(o.strategy_options.pool_buffers)); }},
      {"--threads", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--threads", o.threads,
                         "compute threads per rank, libtorch's and OpenBLAS's (0: OMP_NUM_THREADS, which the launcher "
                         "sets to 1 when unset)")
             ->transform(integer_in(0, 256));
       },
       [](const RunOptions& o) { return one(o.threads); }},
      {"--device", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--device", o.train.device, "cuda = GPU LOCAL_RANK")->transform(a_device());
       },
       [](const RunOptions& o) { return one(o.train.device); }},
      {"--backend", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--backend", o.backend, "nccl needs --device cuda")->check(one_of({"gloo", "nccl"}));
       },
       [](const RunOptions& o) { return one(o.backend); }},
      {"--comm-yield", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option_function<std::string>(
                 "--comm-yield", [&o](const std::string& v) { o.comm_yield = on_off(v); },
                 "backward yields its core at each gradient while a collective is in flight, so Gloo's threads move "
                 "it (Note [Yielding to communication])")
             ->check(one_of({"on", "off"}))
             ->default_str("on");
       },
       [](const RunOptions& o) { return one(o.comm_yield ? "on" : "off"); }},
      {"--trace", W::kEveryCommand, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--trace", o.trace_dir,
                         "write DIR/rankR.trace.json (Chrome trace: chrome://tracing, ui.perfetto.dev)")
             ->type_name("DIR");
       },
       [](const RunOptions& o) { return unless_empty(o.trace_dir); }},
      {"--reference", W::kTrain, Out::kEverywhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd
             .add_option("--reference", o.reference,
                         "single: train the whole model on one device in this process too and compare every rank "
                         "with it; none: the ranks alone, for a model whose training one machine cannot hold (no "
                         "comparison, no final loss)")
             ->check(one_of({"single", "none"}));
       },
       [](const RunOptions& o) { return one(o.reference); }},
      // An output of this invocation: not a rank's, not the run's.
      {"--json", W::kEveryCommand, Out::kNowhere, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--json", o.json, "also write the report as JSON")
             ->check(file_to_write("a file to write"));
       },
       [](const RunOptions&) { return Values{}; }},
      // The launcher's, which kills the run: the ranks never see it.
      {"--timeout", W::kEveryCommand, Out::kConfig, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--timeout", o.timeout_s, "kill the run if it takes longer, in seconds")
             ->transform(integer_in(1, 86400));
       },
       [](const RunOptions& o) { return one(o.timeout_s); }},
      {"--result-dir", W::kWorker, Out::kWorker, nullptr, "",
       [](CLI::App& cmd, RunOptions& o) {
         return cmd.add_option("--result-dir", o.result_dir, "where this rank writes its results")->required();
       },
       [](const RunOptions& o) { return one(o.result_dir); }},
  };
  return table;
}

std::string refusal_of(const RunOption& option, const std::string& strategy) {
  SHARDLAB_INTERNAL_ASSERT(option.needs != nullptr && !option.refusal.empty(),
                           "refusal_of(" + option.flag + "): an option without a capability or refusal words");
  std::string words = option.refusal;
  const size_t at = words.find("{}");
  if (at != std::string::npos) words.replace(at, 2, strategies_that(option.needs));
  return option.flag + " " + words + "; got strategy '" + strategy + "'";
}

}  // namespace shardlab::cli
