// `shardlab bench`, HSDP section: stage 06's HSDP on a 2x2 mesh against FSDP and bucketed DDP on the same 4 ranks,
// then under gradient accumulation with no_sync and with the all-reduce deferred, and PyTorch FSDP2's HSDP on the
// same mesh (and its FSDP) where the trixie root is there. Four ranks oversubscribe this machine's 2 cores: the
// figures are ratios measured in one run, in interleaved rounds. Figures, not assertions.
#include "bench.h"

#include "run.h"
#include "strategies.h"

#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <memory>
#include <sstream>

namespace shardlab::cli {
namespace {

// A group's measured bytes per step and its theory, "measured (theory)", or "-" when the run has no such group.
std::string group_bytes(const RunReport& r, const std::string& role) {
  const auto g = r.groups.find(role);
  if (g == r.groups.end()) return "-";
  return std::to_string(static_cast<int64_t>(g->second.bytes)) + " (" +
         std::to_string(static_cast<int64_t>(g->second.bytes_theory)) + ")";
}

}  // namespace

FsdpBenchResult run_hsdp_bench(const FsdpBenchOptions& b, const std::string& self_exe) {
  RunOptions o = b.run;
  o.world_size = 4;
  const int k = 4;  // micro-batches in the accumulation rows
  struct Row {
    std::string label, strategy;
    int micro_batches;
    bool defer;
    RunReport report;
  };
  std::vector<Row> rows{
      {"bucketed_ddp", "bucketed_ddp", 1, false, {}},
      {"fsdp_prefetch depth 1", "fsdp_prefetch", 1, false, {}},
      {"hsdp 2x2 (prefetch depth 1)", "hsdp", 1, false, {}},
      {"fsdp_prefetch, " + std::to_string(k) + " micro-batches, no_sync", "fsdp_prefetch", k, false, {}},
      {"hsdp 2x2, " + std::to_string(k) + " micro-batches, no_sync", "hsdp", k, false, {}},
      {"hsdp 2x2, " + std::to_string(k) + " micro-batches, all-reduce deferred", "hsdp", k, true, {}}};
  Fsdp2Result peers[2];  // [0]: HSDP 2x2, [1]: FSDP over 4
  std::string peer_why = b.torch ? fsdp2_root_problem(b.torch_root) : "skipped (--no-torch)";
  std::unique_ptr<ProcMount> proc;
  if (peer_why.empty()) proc = std::make_unique<ProcMount>(b.torch_root);
  for (int round = 0; round < b.repeat; ++round) {
    for (auto& row : rows) {
      RunOptions each = o;
      each.strategy = row.strategy;
      each.train.micro_batches = row.micro_batches;
      each.train.global_batch = o.train.global_batch * row.micro_batches;  // the same micro-batch size
      each.strategy_options.prefetch_depth = each.strategy_options.prefetch_limit = 1;
      if (find_strategy(row.strategy).can.mesh) each.strategy_options.mesh = "2x2";
      each.strategy_options.defer_all_reduce = row.defer;
      RunReport r = run_strategy(each, self_exe);
      if (round == 0 || r.step_time_ms < row.report.step_time_ms) row.report = r;
    }
    for (int i = 0; i < 2 && peer_why.empty(); ++i) {
      std::fprintf(stderr, "pytorch_fsdp2 (%s) round %d/%d\n", i == 0 ? "hsdp 2x2" : "fsdp", round + 1, b.repeat);
      Fsdp2Result p = run_fsdp2(b, o, true, i == 0 ? "2x2" : "");
      if (!p.ok)
        peer_why = p.why;
      else if (!peers[i].ok || p.step_ms < peers[i].step_ms)
        peers[i] = p;
    }
  }
  proc.reset();
  int64_t params = 0;
  for (const auto& p : trainable_parameters(*make_model(o.train, at::kCPU))) params += p.numel();
  if (peer_why.empty() && static_cast<int64_t>(peers[0].param_count) != params)
    peer_why = "PyTorch's model has " + std::to_string(static_cast<int64_t>(peers[0].param_count)) +
               " parameters, shardlab's " + std::to_string(params) + ": not the same shape, no ratio";
  const bool peer_ok = peer_why.empty();

  const RunReport& ddp = rows[0].report;
  const RunReport& fsdp = rows[1].report;
  const RunReport& hsdp = rows[2].report;
  std::ostringstream md;
  // Every row's groups are its mesh's: bucketed DDP's replicate group, FSDP's shard group, HSDP's both.
  md << "| run | step ms | / hsdp 2x2 | exposed ms/step | collectives/step | shard group bytes/step (theory) | "
        "replicate group bytes/step (theory) | peak grad bytes | / theory | max abs param diff |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& row : rows) {
    const RunReport& r = row.report;
    const RunReport& base = row.micro_batches == 1 ? hsdp : rows[4].report;  // against hsdp at the same k
    md << "| " << row.label << " | " << fmt(r.step_time_ms, 2) << " | "
       << fmt(r.step_time_ms / std::max(1e-9, base.step_time_ms), 2) << "x | " << fmt(r.exposed_comm_ms_per_step, 2)
       << " | " << r.collectives_per_step << " | " << group_bytes(r, "shard") << " | " << group_bytes(r, "replicate")
       << " | " << static_cast<int64_t>(r.peak_grad_bytes) << " | "
       << fmt(r.peak_grad_bytes / std::max(1.0, r.peak_grad_bytes_theory), 2) << " | " << r.max_param_diff << " |\n";
  }
  for (int i = 0; i < 2 && peer_ok; ++i)
    md << "| pytorch fsdp2 " << (i == 0 ? "hsdp 2x2" : "fsdp over 4") << " (" << peers[i].version << ") | "
       << fmt(peers[i].step_ms, 2) << " | " << fmt(peers[i].step_ms / std::max(1e-9, hsdp.step_time_ms), 2)
       << "x | | | " << static_cast<int64_t>(peers[i].payload) << " payload in all | | | | | |\n";

  std::ostringstream targets;
  targets << "- hsdp 2x2 step time / fsdp_prefetch over 4 = " << fmt(hsdp.step_time_ms / fsdp.step_time_ms, 2)
          << ", / bucketed_ddp = " << fmt(hsdp.step_time_ms / ddp.step_time_ms, 2)
          << " (HSDP gathers and reduce-scatters over 2 ranks and all-reduces over 2; FSDP does all of it over 4. "
             "On one machine no group is slower than another: the cross-machine saving cannot show here)\n";
  const RunReport& no_sync = rows[4].report;
  const RunReport& deferred = rows[5].report;
  targets << "- " << k << " micro-batches, hsdp deferred / no_sync: step time "
          << fmt(deferred.step_time_ms / no_sync.step_time_ms, 2) << "x, gradient peak "
          << fmt(deferred.peak_grad_bytes / std::max(1.0, no_sync.peak_grad_bytes), 2) << "x, replicate-group bytes "
          << group_bytes(deferred, "replicate") << " against " << group_bytes(no_sync, "replicate")
          << " (one all-reduce per unit per step either way; " << k << "x that without either)\n";
  if (peer_ok)
    targets << "- hsdp 2x2 step time / PyTorch FSDP2 HSDP 2x2 = " << fmt(hsdp.step_time_ms / peers[0].step_ms, 2)
            << "; PyTorch FSDP2 HSDP / its FSDP over 4 = " << fmt(peers[0].step_ms / peers[1].step_ms, 2) << "\n";
  else
    targets << "- PyTorch FSDP2's HSDP: no figure, " << peer_why << "\n";

  FsdpBenchResult out;
  std::ostringstream head;
  const std::string host_blas = blas_in(""), peer_blas = peer_ok ? blas_in(b.torch_root) : "";
  head << "model tiny_gpt, " << o.train.layers << " blocks of width " << o.train.dim << " (" << params
       << " parameters), 4 processes on " << host_blas
       << (peer_ok ? ", PyTorch FSDP2 on " + peer_blas : std::string(""))
       << (peer_ok && host_blas != peer_blas ? " (NOT the same BLAS: the ratios compare unlike compute)" : "")
       << " (Gloo on CPU), micro-batch " << o.train.global_batch / 4 << " per rank, " << o.train.steps
       << " steps, sgd; each figure is the best median "
       << "step time of " << b.repeat << " interleaved rounds";
  out.heading = head.str();
  out.markdown = md.str();
  out.targets = targets.str();
  std::vector<RunReport> reports;
  for (const auto& row : rows) reports.push_back(row.report);
  nlohmann::ordered_json peer_rows = nlohmann::ordered_json::array();
  for (int i = 0; i < 2; ++i)
    peer_rows.push_back({{"ok", peer_ok},
                         {"mesh", i == 0 ? "2x2" : ""},
                         {"median_step_ms", peers[i].step_ms},
                         {"payload_bytes_per_step", peers[i].payload},
                         {"torch_version", peers[i].version}});
  // A rank's last line may hold any byte: nlohmann escapes it, and replaces what is not UTF-8.
  out.json =
      nlohmann::ordered_json{
          {"pytorch_fsdp2", peer_rows}, {"peer_problem", peer_why}, {"runs", reports_to_json(reports)}}
          .dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  return out;
}

}  // namespace shardlab::cli
