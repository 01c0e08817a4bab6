#include "options.h"

#include "strategies.h"

#include "shardlab/common/device.h"
#include "shardlab/common/model.h"
#include "shardlab/common/world.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace shardlab::cli {

namespace fs = std::filesystem;
namespace {

long parse_int(const std::string& flag, const std::string& value, long min, long max) {
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || value.empty() || v < min || v > max)
    throw std::invalid_argument(flag + " expects an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                                "]; got '" + value + "'");
  return v;
}

double parse_double(const std::string& flag, const std::string& value) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || !(v > 0))
    throw std::invalid_argument(flag + " expects a positive number; got '" + value + "'");
  return v;
}

// The floating dtypes FSDP's mixed precision takes ("" is not among them: leave the flag out instead).
const std::vector<std::string>& dtype_names() {
  static const std::vector<std::string> names{"float32", "bfloat16", "float16", "float64"};
  return names;
}

std::string one_of(const std::string& flag, const std::string& value, const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return value;
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : "|") + a;
  throw std::invalid_argument(flag + " expects one of " + list + "; got '" + value + "'");
}

// The strategies --bucket-cap-kb auto applies to: those built on stage 02's BucketedDDP.
bool has_buckets(const std::string& strategy) {
  return strategy == "bucketed_ddp" || strategy == "overlap_optimizer" || strategy.rfind("hook_", 0) == 0;
}

// "RxS" as Mesh::parse reads it, re-worded to name the flag, of at most 64 ranks (as --world-size).
std::string mesh_flag(const std::string& flag, const std::string& value) {
  int64_t ranks = 0;
  try {
    const auto [replicas, shards] = Mesh::parse(value);
    ranks = int64_t{replicas} * shards;
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument(flag + " expects replicas x shards as RxS with R, S >= 1 (e.g. 2x2); got '" + value +
                                "'");
  }
  if (ranks > 64)
    throw std::invalid_argument(flag + " expects at most 64 ranks (R x S), as --world-size; got '" + value + "', " +
                                std::to_string(ranks) + " ranks");
  return value;
}

bool given(const std::vector<std::string>& args, const char* flag) {
  return std::find(args.begin(), args.end(), flag) != args.end();
}

}  // namespace

RunOptions parse_options(const std::vector<std::string>& args, bool allow_strategy) {
  RunOptions o;
  o.train.model = "mlp";
  o.train.steps = 10;
  o.train.global_batch = 16;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag.rfind("--", 0) != 0)
      throw std::invalid_argument("unexpected argument '" + flag + "'; flags start with --");
    if (i + 1 >= args.size()) throw std::invalid_argument(flag + " expects a value; got nothing");
    const std::string& v = args[++i];
    if (flag == "--strategy" && allow_strategy)
      o.strategy = one_of(flag, v, strategy_names());
    else if (flag == "--world-size")
      o.world_size = static_cast<int>(parse_int(flag, v, 1, 64));
    else if (flag == "--model")
      o.train.model = one_of(flag, v, model_names());
    else if (flag == "--steps")
      o.train.steps = static_cast<int>(parse_int(flag, v, 1, 100000));
    else if (flag == "--global-batch")
      o.train.global_batch = parse_int(flag, v, 1, 1 << 20);
    else if (flag == "--seed")
      o.train.seed = static_cast<uint64_t>(parse_int(flag, v, 0, 1L << 40));
    else if (flag == "--optimizer")
      o.train.optimizer = one_of(flag, v, {"sgd", "adamw"});
    else if (flag == "--lr")
      o.train.lr = parse_double(flag, v);
    else if (flag == "--micro-batches")
      o.train.micro_batches = static_cast<int>(parse_int(flag, v, 1, 1024));
    else if (flag == "--clip-norm") {
      o.train.clip_norm = parse_double(flag, v);
      if (std::isinf(o.train.clip_norm))
        throw std::invalid_argument("--clip-norm expects a finite positive number; got '" + v + "'");
    } else if (flag == "--clip-norm-type")
      o.train.clip_p = one_of(flag, v, {"2", "inf"}) == "inf" ? std::numeric_limits<double>::infinity() : 2.0;
    else if (flag == "--json")
      o.json = v;
    else if (flag == "--save")
      o.save_dir = v;
    else if (flag == "--save-every")
      o.save_every = static_cast<int>(parse_int(flag, v, 1, 100000));
    else if (flag == "--resume")
      o.resume_dir = v;
    else if (flag == "--timeout")
      o.timeout_s = static_cast<int>(parse_int(flag, v, 1, 86400));
    else if (flag == "--result-dir")
      o.result_dir = v;
    else if (flag == "--bucket-cap-kb" && v == "auto")
      o.strategy_options.auto_caps = true;
    else if (flag == "--bucket-cap-kb")
      o.strategy_options.bucket_cap_bytes = parse_int(flag, v, 1, 1 << 22) * 1024;
    else if (flag == "--first-bucket-kb")
      o.strategy_options.first_bucket_cap_bytes = parse_int(flag, v, 1, 1 << 22) * 1024;
    else if (flag == "--trace")
      o.trace_dir = v;
    else if (flag == "--threads")
      o.threads = static_cast<int>(parse_int(flag, v, 0, 256));
    else if (flag == "--device")
      o.train.device = parse_device(v).str();
    else if (flag == "--backend")
      o.backend = one_of(flag, v, {"gloo", "nccl"});
    else if (flag == "--comm-yield")
      o.comm_yield = one_of(flag, v, {"on", "off"}) == "on";
    else if (flag == "--cpu-allocator")
      o.cpu_allocator = one_of(flag, v, {"system", "pool"});
    else if (flag == "--layers")
      o.train.layers = parse_int(flag, v, 1, 64);
    else if (flag == "--dim")
      o.train.dim = parse_int(flag, v, 2, 4096);
    else if (flag == "--reshard-after-forward")
      o.strategy_options.reshard_after_forward = one_of(flag, v, {"true", "false"}) == "true";
    else if (flag == "--param-dtype")
      o.strategy_options.param_dtype = one_of(flag, v, dtype_names());
    else if (flag == "--reduce-dtype")
      o.strategy_options.reduce_dtype = one_of(flag, v, dtype_names());
    else if (flag == "--prefetch-depth")
      o.strategy_options.prefetch_depth = static_cast<int>(parse_int(flag, v, 0, 64));
    else if (flag == "--prefetch-limit")
      o.strategy_options.prefetch_limit = static_cast<int>(parse_int(flag, v, 0, 64));
    else if (flag == "--pool-buffers")
      o.strategy_options.pool_buffers = one_of(flag, v, {"true", "false"}) == "true";
    else if (flag == "--mesh")
      o.strategy_options.mesh = mesh_flag(flag, v);
    else if (flag == "--defer-all-reduce")
      o.strategy_options.defer_all_reduce = one_of(flag, v, {"true", "false"}) == "true";
    else
      throw std::invalid_argument("unknown flag '" + flag + "'; see shardlab --help");
  }
  if (!o.strategy_options.mesh.empty()) {  // the mesh says how many ranks; --world-size may only agree with it
    const auto [replicas, shards] = Mesh::parse(o.strategy_options.mesh);
    if (given(args, "--world-size") && o.world_size != replicas * shards)
      throw std::invalid_argument("--mesh " + o.strategy_options.mesh + " has " + std::to_string(replicas * shards) +
                                  " ranks; got --world-size " + std::to_string(o.world_size) +
                                  " (drop --world-size or make them agree)");
    o.world_size = replicas * shards;
  }
  for (const char* flag : {"--mesh", "--defer-all-reduce"}) {
    if (allow_strategy && o.strategy != "hsdp" && given(args, flag))
      throw std::invalid_argument(std::string(flag) + " applies to strategy hsdp only; got strategy '" + o.strategy +
                                  "'");
  }
  const int world = o.strategy == "single" ? 1 : o.world_size;
  if (o.strategy == "single" && allow_strategy && o.world_size != 1 && given(args, "--world-size"))
    throw std::invalid_argument("--strategy single runs on one rank; got --world-size " + std::to_string(o.world_size) +
                                " (drop the flag or pass 1)");
  if (o.strategy == "single") o.world_size = 1;
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
  if (!o.json.empty()) {  // checked now, not after the whole training
    const fs::path file(o.json), dir = file.has_parent_path() ? file.parent_path() : fs::path(".");
    std::error_code ec;
    if (fs::is_directory(file, ec))
      throw std::invalid_argument("--json expects a file to write; got '" + o.json + "', a directory");
    if (!fs::is_directory(dir, ec))
      throw std::invalid_argument("--json expects a file in an existing directory; got '" + o.json +
                                  "' (no directory '" + dir.string() + "')");
    if (access(dir.c_str(), W_OK) != 0)
      throw std::invalid_argument("--json expects a file in a directory it can write; got '" + o.json +
                                  "' (directory '" + dir.string() + "' is not writable)");
  }
  if (o.strategy_options.auto_caps && allow_strategy && !has_buckets(o.strategy))
    throw std::invalid_argument(
        "--bucket-cap-kb auto tunes the buckets of bucketed_ddp, overlap_optimizer and the "
        "hook_* strategies; got strategy '" +
        o.strategy + "', which has none");
  if (allow_strategy && !clips(o.strategy) && given(args, "--clip-norm"))
    throw std::invalid_argument(
        "--clip-norm needs the whole gradient before any parameter steps; strategy "
        "overlap_optimizer steps each bucket's parameters inside backward, as its average "
        "lands (use bucketed_ddp)");
  if (!allow_strategy && (given(args, "--save") || given(args, "--resume") || given(args, "--save-every")))
    throw std::invalid_argument(
        "--save, --save-every and --resume are options of shardlab train (compare runs every "
        "strategy, which would all write one checkpoint)");
  if (given(args, "--save-every") && o.save_dir.empty())
    throw std::invalid_argument("--save-every K saves every K steps into --save DIR; got it without --save");
  if (allow_strategy && !checkpoints(o.strategy) && (!o.save_dir.empty() || !o.resume_dir.empty()))
    throw std::invalid_argument(
        "--save and --resume save and load the optimizer's state; strategy overlap_optimizer keeps one optimizer "
        "per parameter inside its reducer, which a checkpoint cannot name (use bucketed_ddp)");
  if (!o.save_dir.empty()) {  // checked now, not after the whole training
    std::error_code ec;
    const fs::path dir(o.save_dir);
    const fs::path parent = fs::absolute(dir).parent_path();
    if (fs::exists(dir, ec) &&
        (!fs::is_directory(dir, ec) || (!fs::exists(dir / "index.json", ec) && !fs::is_empty(dir, ec))))
      throw std::invalid_argument(
          "--save expects a new or empty directory, or a checkpoint to replace; got '" + o.save_dir + "', which is " +
          (fs::is_directory(dir, ec) ? "a directory with other files (no index.json)" : "not a directory"));
    if (fs::is_directory(parent, ec) && access(parent.c_str(), W_OK) != 0)
      throw std::invalid_argument("--save expects a directory it can write beside; got '" + o.save_dir + "' ('" +
                                  parent.string() + "' is not writable)");
  }
  if (!o.resume_dir.empty() && !fs::exists(o.resume_dir) && !fs::exists(o.resume_dir + ".shardlab-old"))
    throw std::invalid_argument(
        "--resume expects a checkpoint (a directory from --save, or a .safetensors file); "
        "got '" +
        o.resume_dir + "', which does not exist");
  if (given(args, "--clip-norm-type") && !given(args, "--clip-norm"))
    throw std::invalid_argument("--clip-norm-type chooses the norm --clip-norm bounds; got it without --clip-norm");
  for (const char* flag : {"--prefetch-depth", "--prefetch-limit"}) {
    if (allow_strategy && !prefetches(o.strategy) && given(args, flag))
      throw std::invalid_argument(std::string(flag) + " sets the prefetch of strategies fsdp_prefetch and hsdp; got " +
                                  "strategy '" + o.strategy + "'");
  }
  return o;
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
                                "--layers",
                                std::to_string(o.train.layers),
                                "--dim",
                                std::to_string(o.train.dim),
                                "--reshard-after-forward",
                                o.strategy_options.reshard_after_forward ? "true" : "false",
                                "--pool-buffers",
                                o.strategy_options.pool_buffers ? "true" : "false"};
  if (prefetches(o.strategy)) {  // only there: the worker refuses them for other strategies, as train does
    args.insert(args.end(), {"--prefetch-depth", std::to_string(o.strategy_options.prefetch_depth), "--prefetch-limit",
                             std::to_string(o.strategy_options.prefetch_limit)});
  }
  if (o.strategy == "hsdp") {
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
  // After the cap itself, which stays the cap auto starts from (parse_options reads the flags in order).
  if (o.strategy_options.auto_caps && has_buckets(o.strategy)) {
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

std::string usage() {
  std::string strategies;
  for (const auto& s : strategy_names()) strategies += (strategies.empty() ? "" : "|") + s;
  return "usage:\n"
         "  shardlab train   --strategy " +
         strategies +
         " [options]   train on N local ranks, compare to one device\n"
         "  shardlab compare [options]                                  every strategy side by side\n"
         "  shardlab export  DIR FILE.safetensors                       a checkpoint (--save DIR) as one file\n"
         "  shardlab bench   [options] [--out PREFIX] [--no-torch]      step time, traffic and overlap of every DDP\n"
         "                                                              strategy beside PyTorch DDP "
         "(PREFIX.json/.md);\n"
         "                   --section ddp|fsdp|reduce_scatter|hsdp|all FSDP beside PyTorch FSDP2; the ring\n"
         "                                                              reduce-scatter beside the all-reduce;\n"
         "                                                              HSDP 2x2 beside FSDP and DDP at 4 ranks\n"
         "options:\n"
         "  --world-size N      ranks (processes)                      default 2\n"
         "  --model M           mlp|tiny_gpt|edge                      default mlp\n"
         "  --layers N          transformer blocks of tiny_gpt         default 4\n"
         "  --dim D             width of tiny_gpt (even)               default 32\n"
         "  --steps K           optimizer steps                        default 10\n"
         "  --global-batch B    examples per step over all ranks       default 16\n"
         "  --seed S            model and data seed                    default 1\n"
         "  --optimizer O       sgd|adamw                              default sgd\n"
         "  --lr X              learning rate                          default 0.05\n"
         "  --micro-batches M   gradient accumulation per step         default 1\n"
         "  --clip-norm X       clip the gradients' global norm to X   default off (not with overlap_optimizer)\n"
         "  --clip-norm-type P  2|inf: the norm --clip-norm bounds     default 2\n"
         "  --save DIR          train: a checkpoint in DIR after the last step (model, optimizer, step; any world\n"
         "                      size and strategy loads it; docs/checkpoints.md)   default none\n"
         "  --save-every K      train: also after every K-th step, replacing it atomically   default off\n"
         "  --resume DIR        train: start from the checkpoint in DIR, at its step, up to --steps (or from a\n"
         "                      .safetensors file of weights: step 0, a fresh optimizer)\n"
         "  --bucket-cap-kb N|auto  bucket cap after the first bucket  default 25600 (25 MiB); auto: both caps\n"
         "                      chosen after step 2 from measured all-reduce costs and gradient-ready times,\n"
         "                      starting from the caps given before it (--bucket-cap-kb 32 --bucket-cap-kb auto)\n"
         "  --first-bucket-kb N cap of the first bucket                default 1024 (1 MiB)\n"
         "  --reshard-after-forward true|false  FSDP: free units after forward   default true\n"
         "  --param-dtype T     FSDP: gather/compute dtype (float32|bfloat16|float16|float64)  default: the "
         "parameters'\n"
         "  --reduce-dtype T    FSDP: reduce-scatter dtype             default: the param dtype\n"
         "  --prefetch-depth N  fsdp_prefetch, hsdp: units whose all-gather is issued ahead, in forward and\n"
         "                      in backward (0: none)                  default 1\n"
         "  --prefetch-limit K  fsdp_prefetch, hsdp: most units ahead at once (0: the depth)  default 0\n"
         "  --mesh RxS          hsdp: R replicas of S shards (sets the world size to R*S)\n"
         "                      default 2x(N/2) for an even world size N >= 4, else 1xN\n"
         "  --defer-all-reduce true|false  hsdp with --micro-batches > 1: reduce-scatter every micro-batch and\n"
         "                      all-reduce across replicas once (false: no_sync)  default false\n"
         "  --cpu-allocator system|pool  every CPU tensor of 1 MiB or more from a reusing pool  default system\n"
         "  --pool-buffers true|false  FSDP: reuse the units' buffers (false: malloc/free each time)  default true\n"
         "  --threads N         compute threads per rank, libtorch's and OpenBLAS's (0: OMP_NUM_THREADS, which\n"
         "                      the launcher sets to 1 when unset) default 0\n"
         "  --device D          cpu|cuda|cuda:N; cuda = GPU LOCAL_RANK  default cpu\n"
         "  --backend B         gloo|nccl (nccl: --device cuda)        default gloo\n"
         "  --comm-yield on|off backward yields its core at each gradient while a collective is in flight, so\n"
         "                      Gloo's threads move it (Note [Yielding to communication]) default on\n"
         "  --trace DIR         write DIR/rankR.trace.json (Chrome trace: chrome://tracing, ui.perfetto.dev)\n"
         "  --json FILE         also write the report as JSON\n"
         "  --timeout SECONDS   kill the run if it takes longer        default 600\n";
}

}  // namespace shardlab::cli
