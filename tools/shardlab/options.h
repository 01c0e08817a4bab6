#pragma once
// Command-line options of `shardlab train`, `shardlab compare` and the hidden `shardlab worker`.

#include "shardlab/course/reference.h"

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace shardlab::cli {

/// Knobs of the wrappers (each strategy reads the ones it has: buckets for DDP, the rest for FSDP).
struct StrategyOptions {
  int64_t bucket_cap_bytes = int64_t{25} << 20;       ///< --bucket-cap-kb: cap of every bucket after the first
  int64_t first_bucket_cap_bytes = int64_t{1} << 20;  ///< --first-bucket-kb: cap of the first bucket
  bool auto_caps =
      false;  ///< --bucket-cap-kb auto: both caps chosen by stage 02's cost model after step 2, from the caps above
  bool reshard_after_forward = true;  ///< --reshard-after-forward true|false (FSDP units)
  std::string param_dtype;            ///< --param-dtype (FSDP; "" = the parameters' own)
  std::string reduce_dtype;           ///< --reduce-dtype (FSDP; "" = the param dtype)
  int prefetch_depth = 1;             ///< --prefetch-depth N (fsdp_prefetch): units ahead in forward and backward
  int prefetch_limit = 0;             ///< --prefetch-limit K (fsdp_prefetch): most units ahead; 0 = the depth
  bool pool_buffers = true;           ///< --pool-buffers true|false (FSDP): reuse the units' buffers, or malloc
  std::string mesh;                   ///< --mesh RxS (hsdp): replicas x shards; "" = mesh_shape()'s default
  bool defer_all_reduce = false;      ///< --defer-all-reduce true|false (hsdp): accumulate by reduce-scattering
                                      ///< every micro-batch and all-reducing once, instead of no_sync
};

/// Everything one run needs; filled from the command line by add_run_options and check_run_options.
struct RunOptions {
  std::string strategy = "naive_ddp";    ///< see strategy_names()
  int world_size = 2;                    ///< ranks (processes)
  TrainConfig train;                     ///< model, optimizer, steps, batch, seed, micro-batches
  std::string json;                      ///< --json FILE: write the report there ("" = none)
  std::string config;                    ///< train: every option in force, as --write-config writes it (TOML)
  std::string result_dir;                ///< worker only: where to write this rank's results
  int timeout_s = 600;                   ///< the launcher kills a job that runs longer
  StrategyOptions strategy_options;      ///< bucket caps
  std::string trace_dir;                 ///< --trace DIR: one Chrome trace per rank there ("" = none)
  int threads = 0;                       ///< --threads N: intra-op threads per rank (0 = libtorch's default)
  std::string backend = "gloo";          ///< --backend gloo|nccl (nccl needs --device cuda)
  std::string cpu_allocator = "system";  ///< --cpu-allocator system|pool: pool = BufferPool for every CPU tensor
  int memory_limit_mib = 0;              ///< --memory-limit-mib N: each worker's RLIMIT_DATA (0 = none)
  bool comm_yield = true;                ///< --comm-yield on|off: progress points (Note [Yielding to communication])
  std::string save_dir;                  ///< --save DIR: a checkpoint there after the last step ("" = none)
  int save_every = 0;                    ///< --save-every K: also after every K-th step (0 = only the last)
  std::string resume_dir;                ///< --resume DIR: start from the checkpoint there, at its step
  std::string reference = "single";      ///< --reference single|none: one device beside the ranks, or none (a
                                         ///< model one machine cannot hold: nothing compared, no parameters written)
};

/// The options of `shardlab train` before any flag: the mlp, 10 steps, a global batch of 16.
RunOptions default_run_options();

/// Adds the run options to `cmd` (CLI11), bound to `o`, whose values now are the defaults --help shows and
/// --write-config writes. `strategy`: with --strategy (train, worker; compare and bench run several). `worker`: with
/// the hidden worker's --result-dir. Every value is checked by a validator that names the flag, what it expects and
/// what came.
void add_run_options(CLI::App& cmd, RunOptions& o, bool strategy, bool worker = false);

/// Why `path` is no checkpoint to read, or "" when it is one: a directory with index.json (or the previous one, kept
/// as PATH.shardlab-old while a save replaced it), or with `weights_file` a .safetensors file. The reason reads after
/// "got 'PATH', ": "which does not exist", "a directory without index.json", ...
std::string checkpoint_problem(const std::string& path, bool weights_file);

/// The flags of `cmd` given so far (long names, "--steps"). Taken when the command line is parsed and before a
/// --config file is read, they are the flags the user typed (train_typed in cli.cpp, taken by train's
/// parse_complete_callback).
std::set<std::string> given_flags(const CLI::App& cmd);

/// After parsing: the checks between flags, and of the paths, that no single flag's validator can make. `given`: the
/// flags typed on the command line (given_flags); a value from --config is a default they may override, so a flag
/// that does not apply is refused only when typed, and a value that cannot work is refused wherever it came from.
/// Returns `o` completed (the world size from --mesh; 1 for single).
/// @throws std::invalid_argument naming the flags, what was expected and what came.
RunOptions check_run_options(const std::set<std::string>& given, RunOptions o, bool allow_strategy);

/// Refuses a run that a config file could not hold: a string with '#', '\\', a quote or a line break (Debian 12's
/// CLI11 2.1 cuts a value at '#', even in quotes, writes '\\' unescaped, and cannot quote a value holding both
/// quotes). Called for --write-config, before training. The report's "config" is written anyway, as a record.
/// @throws std::invalid_argument naming the flag and its value.
void check_config_writable(const RunOptions& o);

/// `args` (flags only) parsed over `defaults` and checked: each bench section's run options.
/// @throws std::invalid_argument naming the flag, what was expected and what came.
RunOptions parse_run_args(const std::vector<std::string>& args, RunOptions defaults, bool allow_strategy);

/// The options as a worker command line (the worker reads it back to the same options: add_run_options, then
/// check_run_options).
std::vector<std::string> to_args(const RunOptions& o);

/// Every option in force, as the TOML `shardlab train --config` reads (CLI11's: the keys of a `train` table):
/// what --write-config writes and the report's "config".
std::string config_toml(const RunOptions& o);

/// The options a config file holds (the TOML config_toml writes, `shardlab train --write-config`), read by the parser
/// `shardlab train --config` uses, over the defaults: `shardlab worker --config FILE`. Not yet checked
/// (check_run_options).
/// @throws CLI::ParseError as `train --config` does (a key no option takes, a bad value, an unreadable file); the
///         caller words it as for train.
RunOptions read_config_file(const std::string& path);

}  // namespace shardlab::cli
