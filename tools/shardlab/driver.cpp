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

std::map<std::string, std::vector<double>> read_rank_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("missing worker result " + path);
  std::map<std::string, std::vector<double>> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string key;
    s >> key;
    double v;
    while (s >> v) out[key].push_back(v);
  }
  return out;
}

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
                << "at step " << first_step << ", and the single-device reference below starts from the model's own "
                << "initialization, not from these weights\n";
    const auto kind = index.metadata.find("optim.kind");
    if (kind != index.metadata.end() && kind->second != o.train.optimizer)
      throw std::invalid_argument("--resume '" + o.resume_dir + "' holds the state of optimizer '" + kind->second +
                                  "'; this run has --optimizer " + o.train.optimizer);
    const auto caps = index.metadata.find("bucketed_ddp.caps");
    if (caps != index.metadata.end() && find_strategy(o.strategy).can.buckets &&
        find_strategy(o.strategy).can.checkpoints())
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
                  << ": the single-device reference below runs this run's settings from step 0\n";
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
  const ReferenceResult ref = train_reference(o.train);
  r.first_step = first_step;
  r.resumed_from = o.resume_dir;
  r.save_dir = o.save_dir;
  r.save_every = o.save_every;
  r.config = o.config;
  r.reference_losses.assign(ref.losses.begin() + first_step, ref.losses.end());
  const int run = o.train.steps - first_step;  // steps this run trained
  at::Tensor ref_flat = at::cat([&] {
    std::vector<at::Tensor> flat;
    for (const auto& p : ref.params) flat.push_back(p.to(at::kDouble).reshape({-1}));
    return flat;
  }());

  r.losses.assign(run, 0.0);
  at::Tensor previous;  // the last parameters whose final loss was computed
  for (int rank = 0; rank < o.world_size; ++rank) {
    const std::string prefix = o.result_dir + "/rank" + std::to_string(rank);
    auto text = read_rank_text(prefix + ".txt");
    const auto& losses = text["losses"];
    if (losses.size() != static_cast<size_t>(run))
      throw std::runtime_error("rank " + std::to_string(rank) + " reported " + std::to_string(losses.size()) +
                               " losses; expected " + std::to_string(run));
    for (int s = 0; s < run; ++s) r.losses[s] += losses[s] / o.world_size;
    if (rank == 0) {
      r.step_time_ms = median(text["step_ms"]);
      r.setup_collectives = text["setup_collectives"].empty() ? 0 : text["setup_collectives"][0];
      r.collectives_per_step = text["collectives"].empty() ? 0 : text["collectives"][0] / run;
      r.bytes_per_step = text["bytes"].empty() ? 0 : text["bytes"][0] / run;
      r.sent_bytes_per_step = text["sent_bytes"].empty() ? 0 : text["sent_bytes"][0] / run;
      r.buckets = text["buckets"].empty() ? 0 : text["buckets"][0];
      r.comm_busy_ms_per_step = text["comm_busy_ms"].empty() ? 0 : text["comm_busy_ms"][0] / run;
      r.exposed_comm_ms_per_step = text["exposed_comm_ms"].empty() ? 0 : text["exposed_comm_ms"][0] / run;
      auto first = [&](const char* key) { return text[key].empty() ? 0.0 : text[key][0]; };
      r.exposed_share_median = text["exposed_share"].empty() ? 0 : median(text["exposed_share"]);
      r.progress_yields_per_step = first("progress_yields") / run;
      r.peak_param_bytes = first("peak_param_bytes");
      r.peak_param_bytes_theory = first("peak_param_bytes_theory");
      r.peak_grad_bytes = first("peak_grad_bytes");
      r.peak_grad_bytes_theory = first("peak_grad_bytes_theory");
      r.auto_caps = text["auto_caps"];
      r.auto_caps_buckets_theory = first("auto_caps_buckets_theory");
      for (const auto& [key, values] : text) {
        if (key.rfind("group_", 0) != 0 || values.size() != 2) continue;
        GroupTraffic& g = r.groups[key.substr(6)];
        g.collectives = values[0] / run;
        g.bytes = values[1] / run;
      }
    }
    for (auto [key, into] :
         {std::pair{"peak_rss_bytes", &r.peak_rss_bytes}, std::pair{"run_peak_rss_bytes", &r.run_peak_rss_bytes},
          std::pair{"base_rss_bytes", &r.base_rss_bytes},
          std::pair{"construction_rss_bytes", &r.construction_rss_bytes},
          std::pair{"base_data_bytes", &r.base_data_bytes}})
      into->push_back(text[key].empty() ? 0.0 : text[key][0]);
    std::ifstream in(prefix + ".params", std::ios::binary);
    at::Tensor mine = at::empty({ref_flat.numel()}, at::kDouble);
    in.read(reinterpret_cast<char*>(mine.data_ptr<double>()), static_cast<std::streamsize>(mine.numel() * 8));
    if (in.gcount() != mine.numel() * 8)
      throw std::runtime_error("rank " + std::to_string(rank) + " wrote parameters of another size than the model");
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
  r.reference_final_loss = ref.final_loss;
  // The bound holds for two runs from the same start; weights alone start elsewhere than the reference.
  r.adamw_param_bound = weights_only ? 0.0 : adamw_divergence_bound(o.train, o.train.steps);
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

void print_report(const RunReport& r) {
  std::cout << "\nshardlab train: " << r.strategy << " (" << r.description << ")\n"
            << "  model " << r.train.model << ", world size " << r.world_size << ", global batch "
            << r.train.global_batch << ", micro-batches " << r.train.micro_batches << ", " << r.train.optimizer
            << " lr " << r.train.lr
            << (r.train.clip_norm > 0 ? ", clip norm " + std::to_string(r.train.clip_norm) +
                                            (std::isinf(r.train.clip_p) ? " (max)" : " (2-norm)")
                                      : std::string())
            << ", seed " << r.train.seed << ", " << r.train.device << " over " << r.backend
            << (r.mesh.empty() ? ""
                               : ", mesh " + r.mesh + " (replicas x shards)" +
                                     (r.defer_all_reduce ? ", all-reduce deferred to the last micro-batch" : ""))
            << "\n\n"
            << "  loss: over the global batch (the mean of the ranks' equal slices), as the progress bar shows it\n"
            << "  step        loss   reference   |difference|\n";
  for (size_t s = 0; s < r.losses.size(); ++s)
    std::cout << "  " << std::setw(4) << s + r.first_step << std::fixed << std::setprecision(6) << std::setw(12)
              << r.losses[s] << std::setw(12) << r.reference_losses[s] << std::scientific << std::setprecision(2)
              << std::setw(15) << std::abs(r.losses[s] - r.reference_losses[s]) << "\n";
  std::ostringstream bound;  // AdamW's own bound beside the difference (Note [Comparing with one device])
  if (r.adamw_param_bound > 0) bound << " (AdamW's bound " << r.adamw_param_bound << ")";
  std::cout << std::defaultfloat << std::setprecision(6)
            << "\n  max parameter difference vs single device: " << r.max_param_diff << bound.str()
            << "\n  final parameters' loss on step " << r.train.steps << "'s batch: " << r.final_loss << " (reference "
            << r.reference_final_loss << ")"
            << "\n  collectives per step: " << r.collectives_per_step << " (theory " << r.collectives_per_step_theory
            << (r.auto_caps.empty() ? "" : " with the caps before auto chose others") << "), plus "
            << r.setup_collectives
            << " at setup\n  bytes per step (rank 0 payload): " << static_cast<int64_t>(r.bytes_per_step) << " (theory "
            << static_cast<int64_t>(r.bytes_per_step_theory) << ")\n";
  if (r.groups.size() > 1)
    for (const auto& [role, g] : r.groups)
      std::cout << "    on the " << role << " group: " << g.collectives << " collectives (theory "
                << g.collectives_theory << "), " << static_cast<int64_t>(g.bytes) << " bytes (theory "
                << static_cast<int64_t>(g.bytes_theory) << ")\n";
  if (r.bytes_per_step != r.bytes_per_step_theory && r.strategy == "hook_bf16")
    std::cout << "  (the backend cannot reduce bf16 and sent it as f32: Gloo 1.13, see Note [Fallbacks])\n";
  if (r.buckets > 0) std::cout << "  buckets: " << r.buckets << "\n";
  if (r.auto_caps.size() == 6)
    std::cout << "  auto caps (chosen after step 2): first " << r.auto_caps[0] / 1024 << " KiB, then "
              << r.auto_caps[1] / 1024 << " KiB; all-reduce alpha " << r.auto_caps[2] / 1e3 << " us, beta "
              << r.auto_caps[3] * 1024 / 1e3 << " us/KiB; modelled exposed " << r.auto_caps[4] / 1e6
              << " ms with the caps before, " << r.auto_caps[5] / 1e6 << " ms with the chosen ones\n";
  if (r.peak_param_bytes > 0)
    std::cout << "  peak memory per rank: parameters " << static_cast<int64_t>(r.peak_param_bytes) << " bytes (theory "
              << static_cast<int64_t>(r.peak_param_bytes_theory) << "), gradients "
              << static_cast<int64_t>(r.peak_grad_bytes) << " bytes (theory "
              << static_cast<int64_t>(r.peak_grad_bytes_theory) << ")" << (r.shards ? ", measured" : ", a full replica")
              << "\n";
  if (!r.peak_rss_bytes.empty()) {  // Note [Peak RSS over the steady state]
    auto mib = [](const std::vector<double>& bytes) {
      std::ostringstream line;
      for (double b : bytes) line << " " << static_cast<int64_t>(b / (1 << 20));
      return line.str() + " MiB";
    };
    std::cout << "  resident memory per rank (what the operating system saw); the model built "
              << (r.construction == "sharded" ? "sharded, unit by unit" : r.construction)
              << "\n    before the model:" << mib(r.base_rss_bytes)
              << "\n    peak once the model was built:" << mib(r.construction_rss_bytes)
              << "\n    peak over the run, construction included:" << mib(r.run_peak_rss_bytes)
              << "\n    peak over the second half of the steps:" << mib(r.peak_rss_bytes)
              << (r.shards ? (r.pool_buffers ? " (buffers pooled)" : " (buffers malloc'd)") : "") << "\n";
    if (r.memory_limit_mib > 0)
      std::cout << "    data memory (VmData, what the limit counts) before the model:" << mib(r.base_data_bytes)
                << "; limit " << r.memory_limit_mib << " MiB (--memory-limit-mib)\n";
    if (r.peak_param_bytes_theory > 0)
      std::cout << "    theory of what a step holds beyond the base: parameters and gradients "
                << static_cast<int64_t>((r.peak_param_bytes_theory + r.peak_grad_bytes_theory) / (1 << 20))
                << " MiB, plus activations and the optimizer's state\n";
  }
  std::cout << std::fixed << std::setprecision(2) << "  median step time: " << r.step_time_ms << " ms\n";
  if (r.world_size > 1) {
    std::cout << "  communication per step: " << r.comm_busy_ms_per_step << " ms in flight, "
              << r.exposed_comm_ms_per_step << " ms exposed (the training thread waited); per step, a median "
              << 100 * r.exposed_share_median << " % of the in-flight time exposed\n  progress points: ";
    if (r.comm_yield)
      std::cout << r.progress_yields_per_step << " yields to communication per step (--comm-yield on"
                << (r.backend == "nccl" || r.train.device != "cpu" ? "; collectives of CUDA tensors are not counted"
                                                                   : "")
                << ")\n";
    else
      std::cout << "off (--comm-yield off)\n";
  }
  if (!r.trace_dir.empty())
    std::cout << "  traces: " << r.trace_dir << "/rank*.trace.json (open in chrome://tracing or ui.perfetto.dev)\n";
  if (!r.resumed_from.empty())
    std::cout << "  resumed from checkpoint '" << r.resumed_from << "' at step " << r.first_step << "\n";
  if (!r.save_dir.empty())
    std::cout << "  checkpoint: '" << r.save_dir << "' at step " << r.train.steps
              << (r.save_every > 0 ? " (also every " + std::to_string(r.save_every) + " steps)" : "")
              << "; shardlab export writes it as one safetensors file\n";
  std::cout << std::defaultfloat;
}

void print_comparison(const std::vector<RunReport>& reports) {
  if (reports.empty()) return;
  const auto& t = reports.front().train;
  std::cout << "\nshardlab compare: model " << t.model << ", global batch " << t.global_batch << ", " << t.steps
            << " steps, " << t.optimizer << " lr " << t.lr << ", seed " << t.seed
            << "; losses over the global batch\n\n";
  std::cout << std::left << std::setw(18) << "strategy" << std::right << std::setw(6) << "world" << std::setw(6)
            << "mesh" << std::setw(12) << "final loss" << std::setw(12) << "reference" << std::setw(14)
            << "max |dparam|" << std::setw(12) << "coll/step" << std::setw(10) << "(theory)" << std::setw(14)
            << "bytes/step" << std::setw(12) << "(theory)" << std::setw(12) << "step ms" << std::setw(13)
            << "exposed ms" << std::setw(12) << "param B" << std::setw(10) << "(theory)" << std::setw(12) << "grad B"
            << std::setw(10) << "(theory)"
            << "\n";
  for (const auto& r : reports) {
    std::cout << std::left << std::setw(18) << r.strategy << std::right << std::setw(6) << r.world_size << std::setw(6)
              << (r.mesh.empty() ? "-" : r.mesh) << std::fixed << std::setprecision(5) << std::setw(12)
              << r.losses.back() << std::setw(12) << r.reference_losses.back() << std::scientific
              << std::setprecision(2) << std::setw(14) << r.max_param_diff << std::defaultfloat << std::setw(12)
              << r.collectives_per_step << std::setw(10) << r.collectives_per_step_theory << std::setw(14)
              << static_cast<int64_t>(r.bytes_per_step) << std::setw(12)
              << static_cast<int64_t>(r.bytes_per_step_theory) << std::fixed << std::setprecision(2) << std::setw(12)
              << r.step_time_ms << std::setw(13) << r.exposed_comm_ms_per_step << std::defaultfloat << std::setw(12)
              << static_cast<int64_t>(r.peak_param_bytes) << std::setw(10)
              << static_cast<int64_t>(r.peak_param_bytes_theory) << std::setw(12)
              << static_cast<int64_t>(r.peak_grad_bytes) << std::setw(10)
              << static_cast<int64_t>(r.peak_grad_bytes_theory) << "\n";
  }
  std::cout << "\nper group and step (rank 0; hsdp: shard = its row, replicate = its column)\n"
            << std::left << std::setw(18) << "strategy" << std::setw(11) << "group" << std::right << std::setw(12)
            << "coll/step" << std::setw(10) << "(theory)" << std::setw(14) << "bytes/step" << std::setw(12)
            << "(theory)\n";
  for (const auto& r : reports)
    for (const auto& [role, g] : r.groups)
      std::cout << std::left << std::setw(18) << r.strategy << std::setw(11) << role << std::right << std::setw(12)
                << g.collectives << std::setw(10) << g.collectives_theory << std::setw(14)
                << static_cast<int64_t>(g.bytes) << std::setw(12) << static_cast<int64_t>(g.bytes_theory) << "\n";
}

namespace {

// A count kept as a double (per step, averaged over steps) written as an integer when it is one, as it was before
// the report was written with nlohmann: "26", not "26.0".
nlohmann::ordered_json count(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.0e15) return static_cast<int64_t>(v);
  return v;
}

nlohmann::ordered_json counts(const std::vector<double>& v) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (double x : v) out.push_back(count(x));
  return out;
}

}  // namespace

nlohmann::ordered_json report_to_json(const RunReport& r) {
  // The documented keys, in this order (README, notebooks/; tests/tools/check_bench_json.py checks the order).
  nlohmann::ordered_json j;
  j["strategy"] = r.strategy;
  j["world_size"] = r.world_size;
  j["model"] = r.train.model;
  j["optimizer"] = r.train.optimizer;
  j["lr"] = r.train.lr;
  j["steps"] = r.train.steps;
  j["global_batch"] = r.train.global_batch;
  j["micro_batches"] = r.train.micro_batches;
  j["clip_norm"] = r.train.clip_norm;
  j["clip_norm_type"] = std::isinf(r.train.clip_p) ? "inf" : "2";
  j["seed"] = r.train.seed;
  j["device"] = r.train.device;
  j["backend"] = r.backend;
  j["first_step"] = r.first_step;
  j["resumed_from"] = r.resumed_from;
  j["save_dir"] = r.save_dir;
  j["save_every"] = r.save_every;
  j["losses"] = r.losses;
  j["reference_losses"] = r.reference_losses;
  j["max_param_diff"] = r.max_param_diff;
  j["final_loss"] = r.final_loss;
  j["reference_final_loss"] = r.reference_final_loss;
  j["adamw_param_bound"] = r.adamw_param_bound;
  j["collectives_per_step"] = count(r.collectives_per_step);
  j["collectives_per_step_theory"] = count(r.collectives_per_step_theory);
  j["setup_collectives"] = count(r.setup_collectives);
  j["bytes_per_step"] = count(r.bytes_per_step);
  j["bytes_per_step_theory"] = count(r.bytes_per_step_theory);
  j["sent_bytes_per_step"] = count(r.sent_bytes_per_step);
  j["step_time_ms"] = r.step_time_ms;
  j["buckets"] = count(r.buckets);
  j["comm_busy_ms_per_step"] = r.comm_busy_ms_per_step;
  j["exposed_comm_ms_per_step"] = r.exposed_comm_ms_per_step;
  j["exposed_share_median"] = r.exposed_share_median;
  j["comm_yield"] = r.comm_yield;
  j["progress_yields_per_step"] = count(r.progress_yields_per_step);
  j["layers"] = r.train.layers;
  j["reshard_after_forward"] = r.reshard_after_forward;
  j["prefetch_depth"] = r.prefetch_depth;
  j["prefetch_limit"] = r.prefetch_limit;
  j["dim"] = r.train.dim;
  j["peak_param_bytes"] = count(r.peak_param_bytes);
  j["peak_param_bytes_theory"] = count(r.peak_param_bytes_theory);
  j["peak_grad_bytes"] = count(r.peak_grad_bytes);
  j["peak_grad_bytes_theory"] = count(r.peak_grad_bytes_theory);
  j["auto_caps"] = counts(r.auto_caps);
  j["auto_caps_buckets_theory"] = count(r.auto_caps_buckets_theory);
  j["pool_buffers"] = r.pool_buffers;
  j["mesh"] = r.mesh;
  j["defer_all_reduce"] = r.defer_all_reduce;
  j["groups"] = nlohmann::ordered_json::object();
  for (const auto& [role, g] : r.groups)
    j["groups"][role] = {{"collectives_per_step", count(g.collectives)},
                         {"collectives_per_step_theory", count(g.collectives_theory)},
                         {"bytes_per_step", count(g.bytes)},
                         {"bytes_per_step_theory", count(g.bytes_theory)}};
  j["peak_rss_bytes"] = counts(r.peak_rss_bytes);
  j["run_peak_rss_bytes"] = counts(r.run_peak_rss_bytes);
  j["base_rss_bytes"] = counts(r.base_rss_bytes);
  j["construction_rss_bytes"] = counts(r.construction_rss_bytes);
  j["base_data_bytes"] = counts(r.base_data_bytes);
  j["memory_limit_mib"] = r.memory_limit_mib;
  j["construction"] = r.construction;
  j["trace_dir"] = r.trace_dir;
  j["config"] = r.config;
  return j;
}

nlohmann::ordered_json reports_to_json(const std::vector<RunReport>& reports) {
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  for (const auto& r : reports) all.push_back(report_to_json(r));
  return all;
}

std::string reports_json(const std::vector<RunReport>& reports, bool as_array) {
  // A path that is not UTF-8 is written with U+FFFD for the bytes JSON cannot hold.
  return (as_array ? reports_to_json(reports) : report_to_json(reports.at(0)))
             .dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) +
         "\n";
}

void write_file_atomically(const std::string& path, const std::string& text) {
  // Write beside the target, then rename: an existing file is only replaced by a complete one.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << text;
    if (!out) throw std::runtime_error("cannot write '" + path + "'");
  }
  fs::rename(tmp, path);
}

void write_json(const std::string& path, const std::vector<RunReport>& reports, bool as_array) {
  write_file_atomically(path, reports_json(reports, as_array));
}

}  // namespace shardlab::cli
