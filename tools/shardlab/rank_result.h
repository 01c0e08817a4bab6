#pragma once
// What one rank of `shardlab worker` hands the driver: its figures as JSON (rankR.json, through nlohmann's type
// macros: a field is named once, in the struct, and once in its macro) and its final parameters as safetensors
// (rankR.safetensors). The driver reads both back, and so do the tests that run `shardlab worker` themselves
// (tests/tools/test_nodes_hsdp.py). See Note [A rank's result files] in rank_result.cpp.

#include "strategies.h"

#include <map>
#include <string>
#include <vector>

namespace shardlab::cli {

/// One group role's traffic on this rank over the run (the steps', without setup).
struct GroupFigures {
  double collectives = 0;  ///< collectives issued on the role's group
  double bytes = 0;        ///< payload bytes handed to the backend on it
  std::string name;        ///< this rank's group of the role, as the recorder names it ("shard(0,1)")
};

/// One rank's figures over its run.
struct RankResult {
  int first_step = 0;                          ///< --resume: the checkpoint's step, the run's first (0 otherwise)
  std::vector<double> losses;                  ///< this rank's slice loss per step run
  std::vector<double> step_ms;                 ///< wall time per step
  double setup_collectives = 0;                ///< collectives outside the steps' training: construction, checkpoints
  double collectives = 0;                      ///< collectives of the steps, over the run
  double bytes = 0;                            ///< their payload bytes
  double sent_bytes = 0;                       ///< bytes this rank sent under ring algorithms
  double comm_busy_ms = 0;                     ///< time a collective was in flight, over the run
  double exposed_comm_ms = 0;                  ///< part of it the training thread waited for
  std::vector<double> exposed_share;           ///< per step with communication: exposed / in flight
  std::map<std::string, GroupFigures> groups;  ///< by role ("world"; hsdp: "shard", "replicate")
  double progress_yields = 0;                  ///< progress points that yielded, over the run
  double buckets = 0;                          ///< gradient buckets (0: a strategy without buckets)
  AutoCapsFigures auto_caps;                   ///< --bucket-cap-kb auto
  double peak_rss_bytes = 0;                   ///< Note [Peak RSS over the steady state] (worker.cpp)
  double run_peak_rss_bytes = 0;               ///< peak resident memory over the whole run
  double base_rss_bytes = 0;                   ///< resident memory before the model was built
  double base_data_bytes = 0;                  ///< VmData before the model was built
  double construction_rss_bytes = 0;           ///< peak resident memory once the model was built and wrapped
  MemoryFigures memory;                        ///< parameter and gradient bytes, measured beside theory
};

/// Writes `result` as `prefix`.json, atomically. @throws std::runtime_error naming the file.
void write_rank_result(const std::string& prefix, const RankResult& result);
/// Reads `prefix`.json. @throws std::runtime_error naming the file, with nlohmann's reason (a missing key is named;
/// a non-finite figure, written as null, is "type must be number").
RankResult read_rank_result(const std::string& prefix);

/// Writes every parameter `runner` visits (full, as one device holds it) as float64 to `prefix`.safetensors, one
/// unit gathered at a time (a collective for the sharded strategies: every rank calls it).
/// @throws std::runtime_error naming the file.
void write_rank_parameters(const std::string& prefix, StepRunner& runner);
/// The parameters `prefix`.safetensors holds, in the model's registration order, as one flat float64 tensor.
/// @throws std::runtime_error naming the file when it is missing or not what write_rank_parameters writes.
at::Tensor read_rank_parameters(const std::string& prefix);

}  // namespace shardlab::cli
