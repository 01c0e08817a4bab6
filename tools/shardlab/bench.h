#pragma once
// `shardlab bench`: every DDP strategy of the course and PyTorch's own DDP on the same model, world size, batch
// and steps, side by side in one run, with the ratios. Figures, not assertions: nothing here is a test.

#include "options.h"

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace shardlab::cli {

/// The DDP section of the benchmark: what to run.
struct DdpBenchOptions {
  RunOptions run;            ///< model shape, world size, batch, steps, caps, threads (strategy set per row)
  int repeat = 3;            ///< interleaved rounds; each figure is the best median
  bool torch = true;         ///< false: no PyTorch DDP peer
  std::string python;        ///< the interpreter with torch (Debian's python3-torch)
  std::string torch_script;  ///< tools/bench/torch_ddp.py
};

/// The DDP section: every DDP strategy of the course, and bucketed DDP over a grid of hand-tuned caps, beside
/// PyTorch's DDP, in interleaved rounds; prints its table. Its markdown goes to `*md` and its JSON (an object) to
/// `*json`. @throws std::runtime_error when a shardlab run fails (a peer failure is reported in the table).
void run_ddp_bench(const DdpBenchOptions& options, const std::string& self_exe, std::string* md, std::string* json);

/// The FSDP section of the benchmark: what to run.
struct FsdpBenchOptions {
  RunOptions run;           ///< model shape, world size, batch, steps, threads (strategy set per row)
  int repeat = 3;           ///< interleaved rounds; each figure is the best median
  bool torch = true;        ///< false: no PyTorch FSDP2 peer
  std::string torch_root;   ///< Debian trixie root with python3-torch (tools/bench/make-torch-root)
  std::string scripts_dir;  ///< where torch_fsdp.py and torch_ddp.py are
};

/// The FSDP section's outputs, for the terminal and for PREFIX.md / PREFIX.json.
struct FsdpBenchResult {
  std::string heading;   ///< what ran, on which BLAS
  std::string markdown;  ///< the table
  std::string targets;   ///< one line per target: met, or missed by how much and why
  std::string json;      ///< the reports and the peer's figures (a JSON object)
};

/// What one run of PyTorch FSDP2 (tools/bench/torch_fsdp.py, in the trixie root) gave.
struct Fsdp2Result {
  bool ok = false;
  std::string why;              ///< when !ok
  double step_ms = 0;           ///< median step, rank 0
  double param_count = 0;       ///< parameters of its model (to check the shape is shardlab's)
  double payload = 0;           ///< bytes per step handed to the collectives, rank 0
  double sent = 0;              ///< bytes per step a ring sends for them, rank 0, by each collective's group size
  std::string version;          ///< torch's
  double base_mib = 0;          ///< the most over the ranks of: resident memory before the model (MiB)
  double construction_mib = 0;  ///< ... its peak by the end of construction
  double run_peak_mib = 0;      ///< ... its peak over the whole run
  double peak_mib = 0;          ///< ... its peak over the timed steps
};

/// Why PyTorch FSDP2 cannot run from `root` (not root, no trixie root, no python3-torch in it), or "" when it can.
std::string fsdp2_root_problem(const std::string& root);

/// Runs PyTorch FSDP2 on `run`'s model shape, world size, batch, steps and threads, from `options`' root and
/// scripts: FSDP over every rank, or HSDP on `mesh` ("RxS", as shardlab's --mesh). /proc must be mounted in the
/// root (ProcMount). A failure is reported in the result, not thrown.
/// @param meta build the model on the meta device, shard it, then to_empty and initialize the shards (how FSDP2's
///        users build a model larger than one rank); false: built whole on every rank first.
Fsdp2Result run_fsdp2(const FsdpBenchOptions& options, const RunOptions& run, bool raf, const std::string& mesh,
                      bool meta = false);

/// The real-size section: the tiny GPT at 25M parameters on 2 ranks and 151M on 4, FSDP with prefetch beside
/// bucketed DDP and PyTorch FSDP2 built on the meta device: the step, the exposed communication, and each rank's
/// resident memory at construction, over the run and over the steady steps. Only when asked for (--section real):
/// minutes, not seconds. @throws std::runtime_error when a shardlab run fails (a peer failure is reported).
FsdpBenchResult run_real_bench(const FsdpBenchOptions& options, const std::string& self_exe);

/// Mounts /proc inside a root while it lives (torch reads it); unmounts it again only if it mounted it.
class ProcMount {
 public:
  explicit ProcMount(const std::string& root);
  ~ProcMount();
  ProcMount(const ProcMount&) = delete;
  ProcMount& operator=(const ProcMount&) = delete;

 private:
  std::string proc_;
  bool mounted_ = false;
};

/// The HSDP section: HSDP on a 2x2 mesh against FSDP and bucketed DDP at world 4, with accumulation under no_sync and
/// with the all-reduce deferred, and PyTorch FSDP2's HSDP and FSDP where its root is there. Ratios from one run (4
/// ranks oversubscribe 2 cores: read the ratios, not the times). @throws std::runtime_error when a run fails.
FsdpBenchResult run_hsdp_bench(const FsdpBenchOptions& options, const std::string& self_exe);

/// Runs shardlab's FSDP (reshard after forward and kept) and bucketed DDP, and PyTorch FSDP2 when its root is
/// there, in interleaved rounds. @throws std::runtime_error when a shardlab run fails (a peer failure is reported).
FsdpBenchResult run_fsdp_bench(const FsdpBenchOptions& options, const std::string& self_exe);

/// The reduce-scatter section's outputs (see run_rs_bench).
struct RsBenchResult {
  std::string heading;   ///< how it was measured
  std::string markdown;  ///< the table
  std::string targets;   ///< bytes against the bound, and how often kAuto picked the faster algorithm
  std::string json;      ///< the probes' figures (a JSON array, one object per world size)
};

/// Times the ring reduce-scatter against the all-reduce fallback at 2, 3 and 4 processes (`run`'s timeout), at
/// sizes from 16 KiB to 4 MiB, best of `repeat` rounds. @throws std::runtime_error when a probe fails.
RsBenchResult run_rs_bench(const RunOptions& run, int repeat, const std::string& self_exe);

/// Body of the hidden `shardlab rs-probe --out FILE [--repeat R]`: one rank of run_rs_bench's measurement (torchrun's
/// environment), `rounds` rounds; rank 0 writes the figures to `out`.
int run_rs_probe(const std::string& out, int rounds);

/// The BLAS that libblas.so.3 resolves to inside `root` ("" = this machine): "OpenBLAS", "reference BLAS (netlib)"...
std::string blas_in(const std::string& root);

/// What a peer script run left behind.
struct PeerRun {
  bool ok = false;      ///< every rank exited 0 and the result file is not empty
  std::string text;     ///< the result file's text
  std::string problem;  ///< when !ok: the launcher's message and the last line a rank printed
};

/// Launches `argv` as `options.world_size` ranks (torchrun's environment, `options.timeout_s`) and reads the file
/// `result` (a path on this machine) that rank 0 writes.
PeerRun run_peer_script(const RunOptions& options, const std::vector<std::string>& argv, const std::string& result);

/// `v` in fixed notation with `precision` digits after the point, as the bench's tables print figures.
std::string fmt(double v, int precision);

/// A peer's result file (`run.text`) as JSON.
/// @throws std::runtime_error naming `what` when the text is not JSON.
nlohmann::json peer_json(const PeerRun& run, const std::string& what);
/// A peer's figures (`run.text` as JSON) into `figures`; false, with `why` set, when there are none: the run failed
/// ("`label` run failed (...)") or `source` wrote no JSON. The bench goes on without them.
bool peer_figures(const PeerRun& run, const std::string& label, const std::string& source, nlohmann::json& figures,
                  std::string& why);

/// The number under `key` in the object `j`; NaN where it is missing or not a number (a figure the peer did not
/// report).
double json_number(const nlohmann::json& j, const std::string& key);

/// The string under `key` in the object `j`; "" where it is missing or not a string.
std::string json_string(const nlohmann::json& j, const std::string& key);

/// What `shardlab bench` takes besides the run options.
struct BenchFlags {
  std::string section = "all";              ///< --section ddp|fsdp|reduce_scatter|hsdp|all|real (all: not real)
  int repeat = 3;                           ///< --repeat: each figure is the best median of this many rounds
  std::string out;                          ///< --out PREFIX for PREFIX.json / PREFIX.md ("" = print only)
  bool no_torch = false;                    ///< --no-torch: no PyTorch peers
  std::string python = "/usr/bin/python3";  ///< --python: Debian's python3-torch lives there
  std::string torch_script;                 ///< --torch-script: tools/bench/torch_ddp.py in the source tree
  std::string torch_root;                   ///< --torch-root: the trixie root with torch 2.6 (FSDP2's peer)
};

/// Adds bench's options to `cmd`, bound to `flags`; the run options it leaves to `cmd.remaining()`.
void add_bench_options(CLI::App& cmd, BenchFlags& flags);

/// Body of `shardlab bench`: prints the table; with --out PREFIX also writes PREFIX.json and PREFIX.md.
/// `run_args`: run options (as for train) over the bench's defaults.
/// @throws std::invalid_argument on a bad flag.
int run_bench(const BenchFlags& flags, const std::vector<std::string>& run_args, const std::string& self_exe);

}  // namespace shardlab::cli
