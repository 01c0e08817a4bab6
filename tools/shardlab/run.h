#pragma once
// Running a strategy: the worker side (one rank process) and the driver side (launch, reference, report).

#include "options.h"

#include <nlohmann/json_fwd.hpp>

#include <map>
#include <string>
#include <vector>

namespace shardlab::cli {

/// Rank 0's traffic per step on the groups of one role, measured beside theory.
struct GroupTraffic {
  double collectives = 0;         ///< collectives per step
  double bytes = 0;               ///< payload bytes handed to the backend per step
  double collectives_theory = 0;  ///< what theory says
  double bytes_theory = 0;        ///< what theory says
};

/// One finished run, ready to print or write as JSON.
struct RunReport {
  std::string strategy;
  std::string description;
  int world_size = 1;
  TrainConfig train;
  std::vector<double> losses;            ///< global loss per step run (mean of the ranks' slice losses)
  std::string reference = "single";      ///< --reference: "single", or "none" (then the reference's figures, the
                                         ///< parameter difference and the final loss are NaN, their lists empty)
  std::vector<double> reference_losses;  ///< the single-device reference, same steps
  int first_step = 0;                    ///< --resume: the checkpoint's step, the first this run ran (0 otherwise)
  std::string resumed_from;              ///< --resume: the checkpoint ("" = none)
  std::string save_dir;                  ///< --save: where the checkpoint went ("" = none)
  int save_every = 0;                    ///< --save-every (0 = only after the last step)
  double max_param_diff = 0;             ///< over all ranks and parameters, against the reference
  double final_loss = 0;                 ///< the final parameters' loss on the next step's batch (the rank farthest
                                         ///< from the reference's), Note [Comparing with one device]
  double reference_final_loss = 0;       ///< the reference's final parameters on the same batch
  double adamw_param_bound = 0;          ///< AdamW: what max_param_diff may reach (adamw_divergence_bound); SGD,
                                         ///< or a resume of weights alone (no common start): 0
  double collectives_per_step = 0;       ///< measured on rank 0, after construction
  double bytes_per_step = 0;             ///< payload bytes rank 0 handed to the backend per step
  double collectives_per_step_theory = 0;
  double bytes_per_step_theory = 0;
  double sent_bytes_per_step = 0;       ///< rank 0: bytes sent per step under ring algorithms (see worker.cpp)
  double setup_collectives = 0;         ///< collectives at construction (broadcast of the initial state)
  double step_time_ms = 0;              ///< median over steps, rank 0
  double buckets = 0;                   ///< gradient buckets (0: strategy without buckets)
  double comm_busy_ms_per_step = 0;     ///< rank 0: time a collective was in flight, per step
  double exposed_comm_ms_per_step = 0;  ///< rank 0: part of it the training thread waited for, per step
  double exposed_share_median = 0;      ///< rank 0: the median over steps of one step's exposed / in-flight time
  double progress_yields_per_step = 0;  ///< rank 0: progress points that yielded, per step
  bool comm_yield = true;               ///< --comm-yield
  double peak_param_bytes = 0;          ///< rank 0: most parameter bytes held at once (FSDP: measured)
  double peak_param_bytes_theory = 0;   ///< what theory says for the same layout
  double peak_grad_bytes = 0;           ///< rank 0: most gradient bytes held at once (FSDP: measured)
  double peak_grad_bytes_theory = 0;    ///< what theory says
  bool reshard_after_forward = true;    ///< FSDP: the units' setting
  int prefetch_depth = 0;               ///< fsdp_prefetch: --prefetch-depth (0 for every other strategy)
  int prefetch_limit = 0;               ///< fsdp_prefetch: the limit in force (0 for every other strategy)
  std::string trace_dir;                ///< where the Chrome traces went ("" = none)
  std::string config;                   ///< train: every option in force, as --write-config writes it ("" otherwise)
  std::string backend;                  ///< "gloo", "nccl", or "none" (single device)
  /// --bucket-cap-kb auto (rank 0, empty otherwise): chosen first and later cap (bytes), alpha (ns), beta (ns per
  /// byte), modelled exposed ns with the caps before and with the chosen ones.
  std::vector<double> auto_caps;
  /// --bucket-cap-kb auto: how many buckets the chosen caps make by the cap rule over the order the layout took
  /// (0 otherwise); the report's `buckets` must equal it once the new layout is in use.
  double auto_caps_buckets_theory = 0;
  /// Every rank's peak resident memory (bytes) over the second half of the steps, what the operating system saw:
  /// VmHWM after resetting it (clear_refs), or the most VmRSS sampled after each step where that is refused.
  /// See Note [Peak RSS over the steady state] in worker.cpp.
  std::vector<double> peak_rss_bytes;
  /// Every rank's peak resident memory over the whole run, construction included, up to the last step.
  std::vector<double> run_peak_rss_bytes;
  /// Every rank's resident memory before the model was built (libtorch, Gloo, the data): the process's base.
  std::vector<double> base_rss_bytes;
  /// Every rank's data memory (VmData: what --memory-limit-mib limits) before the model was built.
  std::vector<double> base_data_bytes;
  /// Every rank's peak resident memory once the model was built and wrapped (the base included).
  std::vector<double> construction_rss_bytes;
  /// How each rank built the model (Strategy::construction): "sharded", or "whole: " and why.
  std::string construction;
  std::string bytes_note;         ///< why the bytes may differ from theory (Strategy::bytes_note); not in the JSON
  bool shards = false;            ///< the strategy shards its parameters (Capabilities::shards): its memory is measured
  int memory_limit_mib = 0;       ///< --memory-limit-mib (0: none)
  bool pool_buffers = true;       ///< FSDP: --pool-buffers
  std::string mesh;               ///< hsdp: "RxS" (replicas x shards); "" for every other strategy
  bool defer_all_reduce = false;  ///< hsdp: --defer-all-reduce
  /// Per group role ("world"; hsdp: "shard", "replicate"): rank 0's traffic per step beside theory. The roles of
  /// theory and of the measurement together.
  std::map<std::string, GroupTraffic> groups;
};

/// Body of `shardlab worker`: trains this rank (RANK etc. from the environment) and writes its results into
/// options.result_dir. Every rank prints "@@progress k K loss" lines; the driver draws their mean (the global batch's
/// loss) as a progress bar.
int run_worker(const RunOptions& options);

/// The step a checkpoint of `shardlab train` was saved at (its metadata's "step"); 0 for a file of weights only
/// (no optimizer state: exported, or saved from PyTorch), which starts a fresh optimizer at step 0.
/// @throws std::invalid_argument naming `path` when the step is not a count.
int resume_step(const std::map<std::string, std::string>& metadata, const std::string& path);

/// Launches the ranks, runs the reference, and assembles the report. @throws std::runtime_error when a rank fails.
RunReport run_strategy(const RunOptions& options, const std::string& self_exe);

/// Prints one run: loss per step beside the reference, difference, traffic beside theory, step time.
void print_report(const RunReport& r);
/// Prints several runs side by side.
void print_comparison(const std::vector<RunReport>& reports);
/// One report as JSON: its documented keys, in a fixed order.
nlohmann::ordered_json report_to_json(const RunReport& r);
/// Several, as an array.
nlohmann::ordered_json reports_to_json(const std::vector<RunReport>& reports);
/// The JSON text of one report (an object, `as_array` false) or several (an array), indented.
std::string reports_json(const std::vector<RunReport>& reports, bool as_array);
/// Writes `text` beside `path`, then renames it there: an existing file is only ever replaced by a complete one.
/// @throws std::runtime_error when it cannot be written.
void write_file_atomically(const std::string& path, const std::string& text);
/// Writes one report (an object) or several (an array) as JSON to `path`, atomically.
void write_json(const std::string& path, const std::vector<RunReport>& reports, bool as_array);

}  // namespace shardlab::cli
