// What a finished run says: the report printed for the terminal (one run, or every strategy side by side) and
// written as JSON, atomically.
#include "run.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab::cli {

namespace fs = std::filesystem;

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
            << "  loss: over the global batch (the mean of the ranks' equal slices), as the progress bar shows it\n";
  const bool compared = r.reference != "none";
  std::cout << (compared ? "  step        loss   reference   |difference|\n" : "  step        loss\n");
  for (size_t s = 0; s < r.losses.size(); ++s) {
    std::cout << "  " << std::setw(4) << s + r.first_step << std::fixed << std::setprecision(6) << std::setw(12)
              << r.losses[s];
    if (compared)
      std::cout << std::setw(12) << r.reference_losses[s] << std::scientific << std::setprecision(2) << std::setw(15)
                << std::abs(r.losses[s] - r.reference_losses[s]);
    std::cout << "\n";
  }
  std::cout << std::defaultfloat << std::setprecision(6);
  if (compared) {
    std::ostringstream bound;  // AdamW's own bound beside the difference (Note [Comparing with one device])
    if (r.adamw_param_bound > 0) bound << " (AdamW's bound " << r.adamw_param_bound << ")";
    std::cout << "\n  max parameter difference vs single device: " << r.max_param_diff << bound.str()
              << "\n  final parameters' loss on step " << r.train.steps << "'s batch: " << r.final_loss
              << " (reference " << r.reference_final_loss << ")";
  } else {
    std::cout << "\n  no single-device reference (--reference none): nothing compared";
  }
  std::cout << "\n  collectives per step: " << r.collectives_per_step << " (theory " << r.collectives_per_step_theory
            << (r.auto_caps.empty() ? "" : " with the caps before auto chose others") << "), plus "
            << r.setup_collectives
            << " at setup\n  bytes per step (rank 0 payload): " << static_cast<int64_t>(r.bytes_per_step) << " (theory "
            << static_cast<int64_t>(r.bytes_per_step_theory) << ")\n";
  if (r.groups.size() > 1)
    for (const auto& [role, g] : r.groups)
      std::cout << "    on the " << role << " group: " << g.collectives << " collectives (theory "
                << g.collectives_theory << "), " << static_cast<int64_t>(g.bytes) << " bytes (theory "
                << static_cast<int64_t>(g.bytes_theory) << ")\n";
  if (r.bytes_per_step != r.bytes_per_step_theory && !r.bytes_note.empty()) std::cout << "  (" << r.bytes_note << ")\n";
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
  j["reference"] = r.reference;
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
