#include "bench.h"

#include "../cli_validators.h"

#include "run.h"
#include "strategies.h"

#include "shardlab/core/model/model.h"
#include "shardlab/course/launcher.h"

#include <unistd.h>
#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>

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

#ifndef SHARDLAB_TORCH_DDP_SCRIPT
#define SHARDLAB_TORCH_DDP_SCRIPT ""
#endif

namespace shardlab::cli {
namespace {

namespace fs = std::filesystem;

// The flags (section, peers, output) and each section's run.
struct BenchOptions : BenchFlags {
  DdpBenchOptions ddp;    // the DDP section
  FsdpBenchOptions fsdp;  // the FSDP section
  bool runs(const char* name) const { return section == name || (section == "all" && std::string(name) != "real"); }
};

BenchOptions bench_options(const BenchFlags& f, const std::vector<std::string>& run_args) {
  BenchOptions b;
  static_cast<BenchFlags&>(b) = f;
  b.fsdp.torch_root = f.torch_root;
  // The benchmark's defaults: the tiny GPT on 2 ranks, one thread each (2 ranks on 2 cores), 60 steps. Bucket
  // caps scaled to the model (111 KiB of gradients; PyTorch's 25 MiB would make one bucket that can only start
  // when backward is over): 16 KiB first, 32 KiB then, about 4 buckets. PyTorch DDP gets the same caps. The run
  // options given override them (the last of a flag given twice), in both sections.
  RunOptions ddp = default_run_options();
  ddp.train.model = "tiny_gpt";
  ddp.world_size = 2;
  ddp.train.steps = 60;
  ddp.train.global_batch = 16;
  ddp.threads = 1;
  ddp.strategy_options.first_bucket_cap_bytes = 16 * 1024;
  ddp.strategy_options.bucket_cap_bytes = 32 * 1024;
  // The FSDP section's: the same tiny GPT made about 1M parameters wide (4 blocks of width 128: 800k), so that
  // communication is not all latency; 20 steps.
  RunOptions fsdp = ddp;
  fsdp.strategy_options = default_run_options().strategy_options;
  fsdp.train.steps = 20;
  fsdp.train.dim = 128;
  fsdp.train.layers = 4;
  b.ddp.run = parse_run_args(run_args, ddp, /*allow_strategy=*/false);
  b.ddp.repeat = b.repeat;
  b.ddp.torch = !b.no_torch;
  b.ddp.python = b.python;
  b.ddp.torch_script = b.torch_script;
  b.fsdp.run = parse_run_args(run_args, fsdp, /*allow_strategy=*/false);
  b.fsdp.repeat = b.repeat;
  b.fsdp.scripts_dir = fs::path(b.torch_script).parent_path().string();  // beside torch_ddp.py (--torch-script)
  b.fsdp.torch = !b.no_torch;
  return b;
}

}  // namespace

nlohmann::json peer_json(const PeerRun& run, const std::string& what) {
  try {
    return nlohmann::json::parse(run.text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(what + " wrote a result that is not JSON (" + e.what() + "): '" + run.text.substr(0, 200) +
                             "'");
  }
}

bool peer_figures(const PeerRun& run, const std::string& label, const std::string& source, nlohmann::json& figures,
                  std::string& why) {
  if (!run.ok) {
    why = label + " run failed (" + run.problem + ")";
    return false;
  }
  try {
    figures = peer_json(run, source);
  } catch (const std::runtime_error& e) {  // no figure, as for a failed run
    why = e.what();
    return false;
  }
  return true;
}

double json_number(const nlohmann::json& j, const std::string& key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : NAN;
}

std::string json_string(const nlohmann::json& j, const std::string& key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

PeerRun run_peer_script(const RunOptions& o, const std::vector<std::string>& argv, const std::string& result) {
  LaunchOptions lo;
  lo.nproc = o.world_size;
  lo.timeout = std::chrono::seconds(o.timeout_s);
  std::string last;
  const LaunchResult r = launch(
      lo, argv, [&](int rank, const std::string& line) { last = "[rank " + std::to_string(rank) + "] " + line; });
  std::ifstream in(result);
  std::stringstream text;
  text << in.rdbuf();
  PeerRun run;
  run.text = text.str();
  run.ok = r.exit_code == 0 && !run.text.empty();
  if (!run.ok) run.problem = r.message + ": " + last;
  return run;
}

std::string fmt(double v, int precision) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(precision) << v;
  return s.str();
}

void add_bench_options(CLI::App& cmd, BenchFlags& f) {
  cmd.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  const char* root = std::getenv("SHARDLAB_TRIXIE_ROOT");
  f.torch_root = root && *root ? root : "/var/cache/shardlab/trixie";
  f.torch_script = SHARDLAB_TORCH_DDP_SCRIPT;
  cmd.add_option(
         "--section", f.section,
         "ddp: every DDP strategy beside PyTorch DDP; fsdp: FSDP beside PyTorch FSDP2; reduce_scatter: the "
         "rings beside the all-reduce and Gloo's all-gather; hsdp: HSDP 2x2 beside FSDP and DDP at 4 ranks; real: "
         "the tiny GPT at 25M and 151M parameters, FSDP beside DDP and FSDP2 on the meta device (minutes; not "
         "in all)")
      ->check(one_of({"ddp", "fsdp", "reduce_scatter", "hsdp", "all", "real"}));
  cmd.add_option("--repeat", f.repeat, "interleaved rounds; each figure is the best median")
      ->transform(integer_in(1, 20));
  cmd.add_option("--out", f.out, "also write PREFIX.md and PREFIX.json")
      ->check(file_to_write("a PREFIX to write PREFIX.md and PREFIX.json"))
      ->type_name("PREFIX");
  cmd.add_flag("--no-torch", f.no_torch, "no PyTorch peers");
  cmd.add_option("--python", f.python, "the python3 with torch (Debian's python3-torch)")
      ->check(existing(false, "the python3 with torch"));
  cmd.add_option("--torch-script", f.torch_script, "PyTorch DDP's script (torch_fsdp.py is beside it)")
      ->check(existing(false, "tools/bench/torch_ddp.py or a script like it"));
  // Not checked: without the root the FSDP section says so and runs the rest.
  cmd.add_option("--torch-root", f.torch_root,
                 "the Debian trixie root with torch 2.6 for FSDP2 (tools/bench/make-torch-root)")
      ->type_name("DIR");
  cmd.allow_extras();  // the run options: see bench_options
  cmd.footer(
      "Any option of shardlab train but --strategy and the checkpoints also applies (shardlab train --help); "
      "it overrides the bench's defaults in every section.");
}

namespace {

// One section's output: printed now, and its markdown and JSON kept for --out.
struct SectionOut {
  std::string md, json;
};

// Prints section result `r` under `label`, and makes its markdown: `title`, the table, `targets_intro` and the
// targets, then `notes`.
template <typename Result>
SectionOut show(const Result& r, const std::string& label, const std::string& title, const std::string& targets_intro,
                const std::string& notes) {
  std::cout << "\nshardlab bench, " << label << ": " << r.heading << "\n\n" << r.markdown << "\n" << r.targets;
  return {"## " + title + "\n\n" + r.heading + ".\n\n" + r.markdown + "\n" + targets_intro + r.targets + "\n" + notes,
          r.json};
}

}  // namespace

int run_bench(const BenchFlags& flags, const std::vector<std::string>& run_args, const std::string& self_exe) {
  const BenchOptions b = bench_options(flags, run_args);
  std::map<std::string, SectionOut> out;  // by section name: what ran
  if (b.runs("ddp")) run_ddp_bench(b.ddp, self_exe, &out["ddp"].md, &out["ddp"].json);
  if (b.runs("fsdp"))
    out["fsdp"] =
        show(run_fsdp_bench(b.fsdp, self_exe), "FSDP", "FSDP beside PyTorch FSDP2", "Targets:\n\n",
             "*Sent bytes* are what each rank sends per step under ring algorithms (an all-gather sends N-1 of its N "
             "chunks, shardlab's ring reduce-scatter N-1 of N rows, an all-reduce twice that), against the lower bound "
             "3(N-1)/N x 4 bytes x parameters for FSDP with resharding after forward (2(N-1)/N without, and for DDP). "
             "*Peak* memory is measured by FSDP's accounting against the layout's theory.\n");
  if (b.runs("reduce_scatter"))
    out["reduce_scatter"] =
        show(run_rs_bench(b.fsdp.run, b.repeat, self_exe), "the rings (reduce-scatter, all-gather)",
             "The rings: reduce-scatter beside the all-reduce fallback, all-gather beside the backend's", "",
             "Gloo has no reduce-scatter: the fallback (what PyTorch's FSDP gets on Gloo) all-reduces the whole "
             "input; the ring is c10d send/recv (Note [Ring reduce-scatter]). Gloo 1.13's list all-gather fills a "
             "flat output of its own and copies it out; the ring all-gather receives straight into the output (Note "
             "[Ring all-gather]). FSDP's units use whichever `auto` picks.\n");
  if (b.runs("hsdp"))
    out["hsdp"] = show(run_hsdp_bench(b.fsdp, self_exe), "HSDP",
                       "HSDP beside FSDP and DDP on 4 ranks, and beside PyTorch FSDP2's HSDP", "",
                       "*Bytes* are rank 0's payload per step on each group (shard: its row of the mesh; replicate: "
                       "its column; world: every rank), beside the layout's theory. Four ranks on two cores: read the "
                       "ratios.\n");
  if (b.runs("real"))
    out["real"] =
        show(run_real_bench(b.fsdp, self_exe), "real sizes",
             "At real sizes: FSDP beside DDP and PyTorch FSDP2 built on the meta device", "",
             "*Construction* is each rank's peak resident memory once the model is built and wrapped; *run peak* "
             "over the whole run; *steady peak* over the timed steps; *base* before the model. *Exposed comm* is "
             "the time rank 0's training thread waited for a collective, of the time one was in flight.\n");
  if (!b.out.empty()) {
    std::string md = "# Benchmark: shardlab beside PyTorch\n\nGenerated by `shardlab bench" +
                     (b.section == "all" ? std::string() : " --section " + b.section) +
                     (b.repeat == 3 ? std::string() : " --repeat " + std::to_string(b.repeat)) + " --out " + b.out +
                     "` (see README). Machine: " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + " CPU cores.\n\n";
    nlohmann::ordered_json all = nlohmann::ordered_json::object();  // each section's JSON, null where it did not run
    bool first = true;
    for (const char* name : {"ddp", "fsdp", "reduce_scatter", "hsdp", "real"}) {
      const auto it = out.find(name);
      const bool ran = it != out.end() && !it->second.md.empty();
      if (ran) md += (first ? "" : "\n") + it->second.md;
      first = first && !ran;
      all[name] =
          ran && !it->second.json.empty() ? nlohmann::ordered_json::parse(it->second.json) : nlohmann::ordered_json();
    }
    write_file_atomically(b.out + ".md", md);
    write_file_atomically(b.out + ".json",
                          all.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n");
    std::cout << "\nwrote " << b.out << ".md and " << b.out << ".json\n";
  }
  return 0;
}

}  // namespace shardlab::cli
