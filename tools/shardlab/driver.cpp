#include "rank_result.h"
#include "run.h"
#include "strategies.h"

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/device/device.h"
#include "shardlab/course/launcher.h"

#include <ATen/ATen.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>

namespace shardlab::cli {
namespace {

namespace fs = std::filesystem;

// Draws "[#####.....] k/K loss (global batch) x" on stderr: in place on a terminal, at quarters otherwise.
class ProgressBar {
 public:
  ProgressBar(std::string label) : label_(std::move(label)), tty_(isatty(STDERR_FILENO) != 0) {}
  void update(int done, int total, double loss) {
    const int width = 30, filled = total > 0 ? done * width / total : width;
    if (!tty_ && done != total && (done * 4 / total) == ((done - 1) * 4 / total)) return;
    std::fprintf(stderr, "%s%-12s [%s%s] %d/%d  loss (global batch) %.4f%s", tty_ ? "\r" : "", label_.c_str(),
                 std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(), done, total, loss,
                 tty_ && done < total ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  std::string label_;
  bool tty_;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

RunReport run_strategy(const RunOptions& options, const std::string& self_exe) {
  const Strategy& strategy = find_strategy(options.strategy);
  RunOptions o = options;
  if (!strategy.can.communicates) o.world_size = 1;
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/shardlab-run-XXXXXX";
  std::vector<char> tmpl(pattern.begin(), pattern.end());
  tmpl.push_back('\0');
  if (mkdtemp(tmpl.data()) == nullptr)
    throw std::runtime_error("cannot create a temporary directory " + pattern + " (TMPDIR, or /tmp)");
  o.result_dir = tmpl.data();
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{o.result_dir};

  if (!o.trace_dir.empty()) {
    std::error_code ec;
    fs::create_directories(o.trace_dir, ec);
    if (ec || !fs::is_directory(o.trace_dir))
      throw std::invalid_argument("--trace expects a directory it can create or write; got '" + o.trace_dir + "' (" +
                                  ec.message() + ")");
    o.trace_dir = fs::absolute(o.trace_dir).string();
  }

  // The ranks may run elsewhere than here: they get absolute paths.
  if (!o.save_dir.empty()) o.save_dir = fs::absolute(o.save_dir).string();
  if (!o.resume_dir.empty()) o.resume_dir = fs::absolute(o.resume_dir).string();
  // --resume: the checkpoint's step is where this run starts (checked here, before any rank starts).
  int first_step = 0;
  bool weights_only = false;  // --resume of weights alone: the reference does not start from them
  if (!o.resume_dir.empty()) {
    const CheckpointIndex index = read_checkpoint_index(o.resume_dir);
    first_step = resume_step(index.metadata, o.resume_dir);
    if (first_step >= o.train.steps)
      throw std::invalid_argument("--resume '" + o.resume_dir + "' holds step " + std::to_string(first_step) +
                                  "; --steps is the step to train up to and must be greater (got " +
                                  std::to_string(o.train.steps) + ")");
    weights_only = !index.metadata.count("optim.kind");
    if (weights_only)
      std::cout << "shardlab: note: --resume '" << o.resume_dir << "' holds weights only: the optimizer starts fresh "
                << "at step " << first_step
                << (o.reference == "none" ? ""
                                          : ", and the single-device reference below starts from the model's own "
                                            "initialization, not from these weights")
                << "\n";
    const auto kind = index.metadata.find("optim.kind");
    if (kind != index.metadata.end() && kind->second != o.train.optimizer)
      throw std::invalid_argument("--resume '" + o.resume_dir + "' holds the state of optimizer '" + kind->second +
                                  "'; this run has --optimizer " + o.train.optimizer);
    const auto caps = index.metadata.find("bucketed_ddp.caps");
    if (caps != index.metadata.end() && strategy.can.buckets && strategy.can.checkpoints())
      std::cout << "shardlab: note: the buckets are laid out as the checkpoint's were (caps " << caps->second
                << " bytes, its order), so that the run continues as the saved one did; --bucket-cap-kb and "
                << "--first-bucket-kb apply to a fresh run\n";
    std::ostringstream lr;
    lr.precision(17);
    lr << o.train.lr;
    const std::map<std::string, std::string> here = {{"model", o.train.model},
                                                     {"seed", std::to_string(o.train.seed)},
                                                     {"global_batch", std::to_string(o.train.global_batch)},
                                                     {"lr", lr.str()}};
    for (const auto& [key, value] : here) {
      const auto saved = index.metadata.find(key);
      if (saved != index.metadata.end() && saved->second != value)
        std::cout << "shardlab: note: --resume '" << o.resume_dir << "' was saved with " << key << " " << saved->second
                  << ", this run has " << value
                  << (o.reference == "none"
                          ? ""
                          : ": the single-device reference below runs this run's settings from step 0")
                  << "\n";
    }
  }

  // Check the device here, once, rather than in every rank: "cuda" puts local rank r on GPU r.
  const c10::Device device = parse_device(o.train.device);
  const int ranks = strategy.can.communicates ? o.world_size : 1;
  device_for_rank(device, 0);  // CUDA requested: this libtorch has it and a GPU is visible
  if (device.is_cuda() && !device.has_index() && ranks > 1 && cuda_device_count() < ranks)
    throw std::invalid_argument("--device cuda puts rank r on GPU r: " + std::to_string(ranks) + " ranks need " +
                                std::to_string(ranks) + " GPUs; " + std::to_string(cuda_device_count()) +
                                " visible (--device cuda:0 shares one GPU between Gloo ranks)");

  LaunchOptions launch_options;
  launch_options.nproc = o.world_size;
  launch_options.timeout = std::chrono::seconds(o.timeout_s);
  // The ranks get the options as flags, from to_args: the serializer config_toml writes the same options with (a
  // worker reads either through add_run_options). Not as a config file: CLI11 2.1's TOML cannot hold a '#', a '\' or
  // both quotes in a value (check_config_writable), and a --save or --trace path may.
  std::vector<std::string> argv{self_exe, "worker"};
  for (auto& a : to_args(o)) argv.push_back(a);
  ProgressBar bar(o.strategy);
  // Every rank reports its loss on its slice; a step is drawn once all have, with their mean: the loss over the
  // global batch (the slices are equal), the quantity the final table prints.
  std::map<int, std::pair<int, double>> reported;  // step -> (ranks that reported it, sum of their losses)
  const LaunchResult result = launch(launch_options, argv, [&](int rank, const std::string& line) {
    int done = 0, total = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "@@progress %d %d %lf", &done, &total, &loss) == 3) {
      auto& [count, sum] = reported[done];
      sum += loss;
      if (++count == ranks) {
        bar.update(done, total, sum / ranks);
        reported.erase(done);
      }
    } else {
      print_prefixed(rank, line);
    }
  });
  if (result.exit_code != 0) throw std::runtime_error(o.strategy + " failed: " + result.message);

  RunReport r;
  r.strategy = o.strategy;
  r.description = strategy.description;
  r.construction = strategy.construction;
  r.bytes_note = strategy.bytes_note;
  r.shards = strategy.can.shards;
  r.memory_limit_mib = o.memory_limit_mib;
  r.world_size = o.world_size;
  r.train = o.train;
  r.trace_dir = o.trace_dir;
  r.reshard_after_forward = o.strategy_options.reshard_after_forward;
  r.pool_buffers = o.strategy_options.pool_buffers;
  if (strategy.can.prefetches) {
    r.prefetch_depth = o.strategy_options.prefetch_depth;
    r.prefetch_limit = o.strategy_options.prefetch_limit > 0 ? o.strategy_options.prefetch_limit
                                                             : std::max(1, o.strategy_options.prefetch_depth);
  }
  if (strategy.can.mesh) {
    const auto [replicas, shards] = mesh_shape(o.strategy_options, o.world_size);
    r.mesh = std::to_string(replicas) + "x" + std::to_string(shards);
    r.defer_all_reduce = o.strategy_options.defer_all_reduce;
  }
  r.comm_yield = o.comm_yield;
  r.backend = strategy.can.communicates ? o.backend : "none";
  r.first_step = first_step;
  r.resumed_from = o.resume_dir;
  r.save_dir = o.save_dir;
  r.save_every = o.save_every;
  r.config = o.config;
  r.reference = o.reference;
  const int run = o.train.steps - first_step;  // steps this run trained
  // --reference none: the ranks alone (nothing compared, no parameters written); else one device's whole run here.
  const bool compared = o.reference != "none";
  ReferenceResult ref;
  at::Tensor ref_flat;
  if (compared) {
    ref = train_reference(o.train);
    r.reference_losses.assign(ref.losses.begin() + first_step, ref.losses.end());
    ref_flat = at::cat([&] {
      std::vector<at::Tensor> flat;
      for (const auto& p : ref.params) flat.push_back(p.to(at::kDouble).reshape({-1}));
      return flat;
    }());
  }

  r.losses.assign(run, 0.0);
  at::Tensor previous;  // the last parameters whose final loss was computed
  for (int rank = 0; rank < o.world_size; ++rank) {
    const std::string prefix = o.result_dir + "/rank" + std::to_string(rank);
    const RankResult result = read_rank_result(prefix);
    const auto& losses = result.losses;
    if (losses.size() != static_cast<size_t>(run))
      throw std::runtime_error("rank " + std::to_string(rank) + " reported " + std::to_string(losses.size()) +
                               " losses; expected " + std::to_string(run));
    for (int s = 0; s < run; ++s) r.losses[s] += losses[s] / o.world_size;
    if (rank == 0) {
      r.step_time_ms = median(result.step_ms);
      r.setup_collectives = result.setup_collectives;
      r.collectives_per_step = result.collectives / run;
      r.bytes_per_step = result.bytes / run;
      r.sent_bytes_per_step = result.sent_bytes / run;
      r.buckets = result.buckets;
      r.comm_busy_ms_per_step = result.comm_busy_ms / run;
      r.exposed_comm_ms_per_step = result.exposed_comm_ms / run;
      r.exposed_share_median = median(result.exposed_share);
      r.progress_yields_per_step = result.progress_yields / run;
      r.peak_param_bytes = result.memory.peak_param_bytes;
      r.peak_param_bytes_theory = result.memory.peak_param_bytes_theory;
      r.peak_grad_bytes = result.memory.peak_grad_bytes;
      r.peak_grad_bytes_theory = result.memory.peak_grad_bytes_theory;
      r.auto_caps = result.auto_caps.caps;
      r.auto_caps_buckets_theory = result.auto_caps.buckets_theory;
      for (const auto& [role, figures] : result.groups) {
        GroupTraffic& g = r.groups[role];
        g.collectives = figures.collectives / run;
        g.bytes = figures.bytes / run;
      }
    }
    r.peak_rss_bytes.push_back(result.peak_rss_bytes);
    r.run_peak_rss_bytes.push_back(result.run_peak_rss_bytes);
    r.base_rss_bytes.push_back(result.base_rss_bytes);
    r.construction_rss_bytes.push_back(result.construction_rss_bytes);
    r.base_data_bytes.push_back(result.base_data_bytes);
    if (!compared) continue;
    const at::Tensor mine = read_rank_parameters(prefix);
    if (mine.numel() != ref_flat.numel())
      throw std::runtime_error("rank " + std::to_string(rank) + " wrote " + std::to_string(mine.numel()) +
                               " parameter values; the model has " + std::to_string(ref_flat.numel()));
    r.max_param_diff = std::max(r.max_param_diff, (mine - ref_flat).abs().max().item<double>());
    // The final parameters' loss on the next batch: what the last update did, seen where AdamW stays tight. Ranks
    // that hold the same parameters as the one before (every replica, every gathered shard) have its loss.
    if (rank > 0 && mine.equal(previous)) continue;
    previous = mine;
    std::vector<at::Tensor> params;
    int64_t offset = 0;
    for (const auto& p : ref.params) {
      params.push_back(mine.narrow(0, offset, p.numel()).view(p.sizes()).to(p.scalar_type()));
      offset += p.numel();
    }
    const double loss = loss_at(o.train, params, o.train.steps);
    if (rank == 0 || std::abs(loss - ref.final_loss) > std::abs(r.final_loss - ref.final_loss)) r.final_loss = loss;
  }
  if (compared) {
    r.reference_final_loss = ref.final_loss;
    // The bound holds for two runs from the same start; weights alone start elsewhere than the reference.
    r.adamw_param_bound = weights_only ? 0.0 : adamw_divergence_bound(o.train, o.train.steps);
  } else {  // nothing was compared: no figure may read as a perfect match
    r.max_param_diff = r.final_loss = r.reference_final_loss = r.adamw_param_bound =
        std::numeric_limits<double>::quiet_NaN();
  }
  const Theory theory = strategy.theory(*make_model(o.train, at::kCPU), o.world_size, o.strategy_options, o.train);
  r.collectives_per_step_theory = theory.collectives;
  r.bytes_per_step_theory = theory.bytes;
  if (strategy.can.communicates) {
    const std::map<std::string, Traffic> by_role =
        theory.groups.empty() ? std::map<std::string, Traffic>{{"world", {theory.collectives, theory.bytes}}}
                              : theory.groups;
    for (const auto& [role, t] : by_role) {
      r.groups[role].collectives_theory = t.collectives;
      r.groups[role].bytes_theory = t.bytes;
    }
  }
  return r;
}

}  // namespace shardlab::cli
