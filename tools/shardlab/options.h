#pragma once
// Command-line options of `shardlab train`, `shardlab compare` and the hidden `shardlab worker`.

#include "shardlab/common/reference.h"

#include <string>
#include <vector>

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

/// Everything one run needs; filled from flags by parse_options.
struct RunOptions {
  std::string strategy = "naive_ddp";    ///< see strategy_names()
  int world_size = 2;                    ///< ranks (processes)
  TrainConfig train;                     ///< model, optimizer, steps, batch, seed, micro-batches
  std::string json;                      ///< --json FILE: write the report there ("" = none)
  std::string result_dir;                ///< worker only: where to write this rank's results
  int timeout_s = 600;                   ///< the launcher kills a job that runs longer
  StrategyOptions strategy_options;      ///< bucket caps
  std::string trace_dir;                 ///< --trace DIR: one Chrome trace per rank there ("" = none)
  int threads = 0;                       ///< --threads N: intra-op threads per rank (0 = libtorch's default)
  std::string backend = "gloo";          ///< --backend gloo|nccl (nccl needs --device cuda)
  std::string cpu_allocator = "system";  ///< --cpu-allocator system|pool: pool = BufferPool for every CPU tensor
  bool comm_yield = true;                ///< --comm-yield on|off: progress points (Note [Yielding to communication])
  std::string save_dir;                  ///< --save DIR: a checkpoint there after the last step ("" = none)
  int save_every = 0;                    ///< --save-every K: also after every K-th step (0 = only the last)
  std::string resume_dir;                ///< --resume DIR: start from the checkpoint there, at its step
};

/// Parses `args` (without the subcommand). `allow_strategy` is false for compare (it runs them all).
/// @throws std::invalid_argument naming the flag, what was expected and what came.
RunOptions parse_options(const std::vector<std::string>& args, bool allow_strategy);

/// The flags as a worker command line (inverse of parse_options).
std::vector<std::string> to_args(const RunOptions& o);

/// Usage text for `shardlab --help`.
std::string usage();

}  // namespace shardlab::cli
