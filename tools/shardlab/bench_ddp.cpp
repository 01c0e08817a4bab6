// `shardlab bench --section ddp`: every DDP strategy of the course, and bucketed DDP over a grid of hand-tuned
// bucket caps, beside PyTorch's own DDP (tools/bench/torch_ddp.py) on the same model, world size, batch and steps,
// in interleaved rounds. Figures, not assertions.
#include "bench.h"

#include "run.h"
#include "strategies.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::cli {
namespace {

namespace fs = std::filesystem;

// The rows the benchmark compares: the strategies with communication, two of them also with --bucket-cap-kb auto,
// and the last two without progress points, beside rows 1 and 2 (the same strategies and caps) with them: Note
// [Yielding to communication].
struct BenchRow {
  std::string strategy;
  bool auto_caps = false;
  bool comm_yield = true;
};
const std::vector<BenchRow> kRows{{"naive_ddp"},
                                  {"bucketed_ddp"},
                                  {"overlap_optimizer"},
                                  {"bucketed_ddp", true},
                                  {"overlap_optimizer", true},
                                  {"hook_allreduce"},
                                  {"hook_fp16"},
                                  {"hook_bf16"},
                                  {"bucketed_ddp", false, false},
                                  {"overlap_optimizer", false, false}};
// Hand tuning, for comparison with auto caps: bucketed_ddp over this grid of (first, later) caps in KiB, in every
// round.
const std::vector<std::pair<int, int>> kHandCaps{{4, 16}, {8, 32}, {16, 32}, {16, 64}, {32, 64}, {64, 128}, {128, 128}};

// PyTorch's DDP on the same model shape: tools/bench/torch_ddp.py under our launcher (torchrun's environment).
struct TorchResult {
  bool ok = false;
  std::string why;  // when !ok
  double step_ms = 0, param_count = 0, buckets = 0;
  std::string version;
};

TorchResult run_torch(const DdpBenchOptions& b) {
  TorchResult t;
  if (b.torch_script.empty() || !fs::exists(b.torch_script)) {
    t.why = "script not found: '" + b.torch_script + "' (pass --torch-script PATH)";
    return t;
  }
  char tmpl[] = "/tmp/shardlab-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("cannot create a temporary directory under /tmp");
  const std::string json = std::string(tmpl) + "/torch.json";
  const auto& o = b.run;
  std::vector<std::string> argv{b.python,
                                b.torch_script,
                                "--steps",
                                std::to_string(o.train.steps),
                                "--global-batch",
                                std::to_string(o.train.global_batch),
                                "--bucket-cap-kb",
                                std::to_string(o.strategy_options.bucket_cap_bytes / 1024),
                                "--first-bucket-kb",
                                std::to_string(o.strategy_options.first_bucket_cap_bytes / 1024),
                                "--threads",
                                std::to_string(o.threads > 0 ? o.threads : 1),
                                "--layers",
                                std::to_string(o.train.layers),
                                "--dim",
                                std::to_string(o.train.dim),
                                "--json",
                                json};
  const PeerRun run = run_peer_script(o, argv, json);
  fs::remove_all(tmpl);
  nlohmann::json j;
  if (!peer_figures(run, "PyTorch DDP", "PyTorch DDP (" + b.torch_script + ")", j, t.why)) return t;
  t.ok = true;
  t.step_ms = json_number(j, "median_step_ms");
  t.param_count = json_number(j, "param_count");
  t.buckets = json_number(j, "num_buckets");
  t.version = json_string(j, "torch_version");
  return t;
}

}  // namespace

void run_ddp_bench(const DdpBenchOptions& b, const std::string& self_exe, std::string* md_out, std::string* json_out) {
  const auto& o = b.run;
  // Rounds: every strategy and PyTorch once per round, interleaved, so a slow spell of this (shared, 2-core)
  // machine hits every contender alike; each figure is the best median of the rounds.
  std::vector<RunReport> rows(kRows.size()), hand(kHandCaps.size());
  TorchResult torch;
  if (!b.torch) torch.why = "skipped (--no-torch)";
  bool torch_failed = false;
  for (int k = 0; k < b.repeat; ++k) {
    for (size_t i = 0; i < kRows.size(); ++i) {
      RunOptions each = o;
      each.strategy = kRows[i].strategy;
      each.strategy_options.auto_caps = kRows[i].auto_caps;
      each.comm_yield = o.comm_yield && kRows[i].comm_yield;  // --comm-yield off turns off every row's
      RunReport r = run_strategy(each, self_exe);
      if (kRows[i].auto_caps) r.strategy += " (auto caps)";
      if (!kRows[i].comm_yield) r.strategy += " (no yield)";
      if (k == 0 || r.step_time_ms < rows[i].step_time_ms) rows[i] = r;
    }
    for (size_t i = 0; i < kHandCaps.size(); ++i) {
      RunOptions each = o;
      each.strategy = "bucketed_ddp";
      each.strategy_options.auto_caps = false;
      each.strategy_options.first_bucket_cap_bytes = int64_t{kHandCaps[i].first} << 10;
      each.strategy_options.bucket_cap_bytes = int64_t{kHandCaps[i].second} << 10;
      RunReport r = run_strategy(each, self_exe);
      if (k == 0 || r.step_time_ms < hand[i].step_time_ms) hand[i] = r;
    }
    if (b.torch && !torch_failed) {
      std::fprintf(stderr, "pytorch_ddp  round %d/%d\n", k + 1, b.repeat);
      TorchResult t = run_torch(b);
      if (!t.ok) {
        torch = t;
        torch_failed = true;
      } else if (!torch.ok || t.step_ms < torch.step_ms) {
        torch = t;
      }
    }
  }
  // The hand-tuned best: bucketed_ddp's fastest cap pair of the grid, each pair measured as the rows are.
  RunReport hand_best;
  std::pair<int, int> hand_caps{0, 0};
  for (size_t i = 0; i < kHandCaps.size(); ++i)
    if (hand_caps.first == 0 || hand[i].step_time_ms < hand_best.step_time_ms) {
      hand_best = hand[i];
      hand_caps = kHandCaps[i];
    }
  int64_t params = 0;
  for (const auto& p : trainable_parameters(*make_model(o.train, at::kCPU))) params += p.numel();
  if (torch.ok && static_cast<int64_t>(torch.param_count) != params) {
    torch.ok = false;
    torch.why = "PyTorch model has " + std::to_string(static_cast<int64_t>(torch.param_count)) +
                " parameters, shardlab's " + std::to_string(params) + ": not the same shape, no ratio";
  }

  // The table (also the markdown file).
  std::ostringstream md;
  md << "| strategy | step ms | vs PyTorch DDP | collectives/step | bytes/step | buckets | comm ms/step | exposed "
        "ms/step | exposed % of comm | exposed % of comm, median over steps | exposed % of step | yields/step | max "
        "abs "
        "param diff |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto pct = [](double a, double b) { return b > 0 ? 100.0 * a / b : 0.0; };
  for (const auto& r : rows) {
    md << "| " << r.strategy << " | " << fmt(r.step_time_ms, 2) << " | "
       << (torch.ok ? fmt(r.step_time_ms / torch.step_ms, 2) + "x" : "n/a") << " | " << r.collectives_per_step << " | "
       << static_cast<int64_t>(r.bytes_per_step) << " | " << r.buckets << " | " << fmt(r.comm_busy_ms_per_step, 2)
       << " | " << fmt(r.exposed_comm_ms_per_step, 2) << " | "
       << fmt(pct(r.exposed_comm_ms_per_step, r.comm_busy_ms_per_step), 0) << " % | "
       << fmt(100 * r.exposed_share_median, 0) << " % | " << fmt(pct(r.exposed_comm_ms_per_step, r.step_time_ms), 0)
       << " % | " << fmt(r.progress_yields_per_step, 1) << " | " << r.max_param_diff << " |\n";
  }
  if (torch.ok)
    md << "| pytorch_ddp (" << torch.version << ") | " << fmt(torch.step_ms, 2) << " | 1.00x | | | "
       << (std::isnan(torch.buckets) ? std::string("") : fmt(torch.buckets, 0)) << " | | | | | | | |\n";

  // Targets (issue 3): each says met or by how much it was missed.
  const RunReport* naive = &rows[0];
  const RunReport* bucketed = &rows[1];
  std::ostringstream targets;
  if (torch.ok) {
    const double ratio = bucketed->step_time_ms / torch.step_ms;
    targets << "- bucketed DDP step time / PyTorch DDP = " << fmt(ratio, 2)
            << " (target <= 0.90): " << (ratio <= 0.9 ? "met" : "MISSED by " + fmt(ratio - 0.9, 2)) << "\n";
  } else {
    targets << "- bucketed DDP vs PyTorch DDP: no figure, " << torch.why << "\n";
  }
  // Exposure against the 25 % target: over the whole run, and the median over steps (a stalled core moves the first).
  auto exposure = [&](const RunReport& r) {
    const double total = pct(r.exposed_comm_ms_per_step, r.comm_busy_ms_per_step);
    const double median = 100 * r.exposed_share_median;
    return fmt(total, 0) + " % of its communication time over the run (target <= 25 %): " +
           (total <= 25 ? std::string("met") : "MISSED by " + fmt(total - 25, 0) + " points") + "; " + fmt(median, 0) +
           " % as the median over steps: " +
           (median <= 25 ? std::string("met") : "MISSED by " + fmt(median - 25, 0) + " points") + "; " +
           fmt(pct(r.exposed_comm_ms_per_step, r.step_time_ms), 0) + " % of its step time\n";
  };
  targets << "- bucketed DDP exposed communication = " << exposure(*bucketed);
  // Issue 11's targets, for the optimizer overlapped with the all-reduces: with the bench's caps and with auto caps.
  for (const RunReport* overlap : {&rows[2], &rows[4]}) {
    if (torch.ok) {
      const double ratio = overlap->step_time_ms / torch.step_ms;
      targets << "- " << overlap->strategy << " step time / PyTorch DDP = " << fmt(ratio, 2)
              << " (target <= 0.75): " << (ratio <= 0.75 ? "met" : "MISSED by " + fmt(ratio - 0.75, 2)) << "\n";
    }
    targets << "- " << overlap->strategy << " exposed communication = " << exposure(*overlap);
  }
  // Progress points: the same strategy and fixed caps with and without them (rounds interleaved; each row its
  // fastest round). With --comm-yield off every row ran without them: nothing to compare.
  if (!o.comm_yield) targets << "- progress points: off in every row (--comm-yield off)\n";
  for (const auto& [with, without] :
       {std::pair<const RunReport*, const RunReport*>{&rows[1], &rows[8]}, {&rows[2], &rows[9]}}) {
    if (!o.comm_yield) break;
    targets << "- progress points (" << fmt(with->progress_yields_per_step, 1) << " yields per step) for "
            << with->strategy << ": exposed "
            << fmt(pct(with->exposed_comm_ms_per_step, with->comm_busy_ms_per_step), 0)
            << " % of communication over the run, " << fmt(100 * with->exposed_share_median, 0)
            << " % as the median over steps, " << fmt(with->step_time_ms, 2) << " ms per step; without them "
            << fmt(pct(without->exposed_comm_ms_per_step, without->comm_busy_ms_per_step), 0) << " %, "
            << fmt(100 * without->exposed_share_median, 0) << " %, " << fmt(without->step_time_ms, 2) << " ms\n";
  }
  for (size_t i = 0; i < kRows.size(); ++i)
    if (kRows[i].auto_caps && rows[i].auto_caps.size() == 6)
      targets << "- " << rows[i].strategy << " chose " << fmt(rows[i].auto_caps[0] / 1024, 0) << " KiB first, "
              << fmt(rows[i].auto_caps[1] / 1024, 0) << " KiB then (alpha " << fmt(rows[i].auto_caps[2] / 1e3, 1)
              << " us, beta " << fmt(rows[i].auto_caps[3] * 1024 / 1e3, 2)
              << " us/KiB): " << fmt(rows[i].step_time_ms, 2) << " ms per step, modelled exposed "
              << fmt(rows[i].auto_caps[4] / 1e6, 2) << " ms with the bench's caps, "
              << fmt(rows[i].auto_caps[5] / 1e6, 2) << " ms with its own\n";
  targets << "- bucketed_ddp caps: the bench's " << o.strategy_options.first_bucket_cap_bytes / 1024 << "/"
          << o.strategy_options.bucket_cap_bytes / 1024 << " KiB " << fmt(bucketed->step_time_ms, 2)
          << " ms; hand-tuned best of " << kHandCaps.size() << " cap pairs " << hand_caps.first << "/"
          << hand_caps.second << " KiB " << fmt(hand_best.step_time_ms, 2) << " ms (each the best of " << b.repeat
          << " rounds, like the rows); PyTorch's defaults are 1024/25600 KiB (one bucket for this model)\n";
  const double fewer =
      bucketed->collectives_per_step > 0 ? naive->collectives_per_step / bucketed->collectives_per_step : 0;
  const double faster = bucketed->step_time_ms > 0 ? naive->step_time_ms / bucketed->step_time_ms : 0;
  targets << "- naive vs bucketed: " << fmt(fewer, 1)
          << "x fewer collectives (target >= 2x): " << (fewer >= 2 ? "met" : "MISSED")
          << "; naive step / bucketed step = " << fmt(faster, 2) << " (target > 1): " << (faster > 1 ? "met" : "MISSED")
          << "\n";

  std::ostringstream head;
  head << "model " << o.train.model << " (" << params << " parameters), world size " << o.world_size
       << " (processes, Gloo on CPU), global batch " << o.train.global_batch << ", " << o.train.steps << " steps, sgd, "
       << (o.threads > 0 ? std::to_string(o.threads) : std::string("default")) << " thread(s) per rank, "
       << "bucket caps " << o.strategy_options.first_bucket_cap_bytes / 1024 << " KiB first, "
       << o.strategy_options.bucket_cap_bytes / 1024 << " KiB then; each figure is the best median step time of "
       << b.repeat << " interleaved rounds";
  std::cout << "\nshardlab bench, DDP: " << head.str() << "\n\n" << md.str() << "\n" << targets.str();
  *md_out = "## DDP beside PyTorch DDP\n\n" + head.str() + ". Machine: " + blas_in("") + " on the host.\n\n" +
            md.str() + "\nTargets:\n\n" + targets.str() +
            "\n*Exposed* communication is the time the training thread waited for collectives at the end of "
            "backward (nothing hid it), as a share of the time any collective was in flight: over the whole run, and "
            "as the median over steps of each step's share. *Yields* are the progress points per step at which "
            "backward gave its core to the "
            "threads moving a collective in flight (Note [Yielding to communication]; *no yield*: `--comm-yield "
            "off`). Step times are medians over the steps of one run (the first steps included).\n";
  const nlohmann::ordered_json json{
      {"pytorch_ddp",
       {{"ok", torch.ok}, {"median_step_ms", torch.ok ? torch.step_ms : 0.0}, {"torch_version", torch.version}}},
      {"repeat", b.repeat},
      {"threads", o.threads},
      {"strategies", reports_to_json(rows)}};
  *json_out = json.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace shardlab::cli
