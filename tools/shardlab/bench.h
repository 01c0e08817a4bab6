#pragma once
// `shardlab bench`: every DDP strategy of the course and PyTorch's own DDP on the same model, world size, batch
// and steps, side by side in one run, with the ratios. Figures, not assertions: nothing here is a test.

#include "options.h"

#include <string>
#include <vector>

namespace shardlab::cli {

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
/// environment); rank 0 writes the figures to FILE. @throws std::invalid_argument on a bad flag.
int run_rs_probe(const std::vector<std::string>& args);

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

/// The number after `"key":` in a JSON text (NaN when absent). Enough for the peers' flat result files.
double json_number(const std::string& text, const std::string& key);

/// Body of `shardlab bench ARGS`: prints the table; with --out PREFIX also writes PREFIX.json and PREFIX.md.
/// @throws std::invalid_argument on a bad flag.
int run_bench(const std::vector<std::string>& args, const std::string& self_exe);

}  // namespace shardlab::cli
