#pragma once
// The strategies `shardlab train` and `shardlab compare` know. Extension point: a later stage adds one entry to
// strategies() in strategies.cpp (a name, a theory of its traffic, and a factory for its StepRunner).

#include "options.h"

#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/trace.h"
#include "shardlab/course/reference.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::cli {

/// Bytes per rank of parameters and gradients, measured beside theory (0: not reported).
struct MemoryFigures {
  double peak_param_bytes = 0;
  double peak_param_bytes_theory = 0;
  double peak_grad_bytes = 0;
  double peak_grad_bytes_theory = 0;
};

/// Trains one rank's share: owns the model, its data-parallel wrapper and the optimizer.
/// What StepRunner::visit_full_parameters calls with each parameter.
using ParameterVisitor = std::function<void(const at::Tensor& full)>;

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  /// One optimizer step on this rank's slice of the global batch (split into micro-batches); returns the mean
  /// loss over that slice.
  virtual double step(const Batch& local) = 0;
  /// Calls `visit` with every parameter of the full model (registration order), as a single device would hold it;
  /// the sharded strategies gather one unit at a time, so a model larger than one rank is never whole here.
  virtual void visit_full_parameters(const ParameterVisitor& visit) = 0;
  /// Number of gradient buckets (0 for strategies without buckets).
  virtual size_t buckets() const { return 0; }
  /// Parameter and gradient memory per rank: the peak over the steps so far (measured by FSDP's accounting; a
  /// replica's full size for the other strategies) beside what theory says.
  virtual MemoryFigures memory() const { return {}; }
  /// Where step() records its forward, backward and optimizer spans (null: nowhere); also turns on whatever
  /// counters the strategy keeps for the trace (FSDP: bytes held).
  virtual void set_timeline(Timeline* timeline) { timeline_ = timeline; }
  /// Counter samples for the trace (FSDP: parameter and gradient bytes held over time; others: none).
  virtual std::vector<CounterSample> counters() const { return {}; }
  /// Extra figures for the report, as `key value...` lines of the rank's result file (auto caps: what was chosen).
  virtual std::map<std::string, std::vector<double>> extra() const { return {}; }
  /// Saves a checkpoint of the model and the optimizer in `dir` with `metadata` (a collective over the ranks).
  virtual void save(const std::string& dir, const std::map<std::string, std::string>& metadata) = 0;
  /// Loads the checkpoint at `path` into the model and the optimizer (a collective); returns its metadata.
  virtual std::map<std::string, std::string> load(const std::string& path) = 0;
  /// Recorder indices [first, last) of collectives that were setup inside a step (auto caps' measurement), not
  /// training: the worker leaves them out of the per-step figures. Empty (0, 0) when there were none.
  virtual std::pair<size_t, size_t> setup_records() const { return {0, 0}; }

 protected:
  Timeline* timeline_ = nullptr;  ///< see set_timeline
};

/// Collectives and payload bytes per rank per step.
struct Traffic {
  double collectives = 0;  ///< collectives per step
  double bytes = 0;        ///< payload bytes per rank per step
};

/// What a strategy should send per step, in theory: in all, and per group role.
struct Theory {
  double collectives = 0;  ///< collectives per step, over every group
  double bytes = 0;        ///< payload bytes per rank per step, over every group
  /// The same per group role ("world"; HSDP: "shard", "replicate"), the part of a group's name before its ranks
  /// (group_role). Empty: everything on "world".
  std::map<std::string, Traffic> groups;
};

/// The role of a group named by World: "shard(0,1)" -> "shard", "world" -> "world".
std::string group_role(const std::string& group_name);

/// A named way to train.
struct Strategy {
  std::string name;         ///< the --strategy value
  std::string description;  ///< one line for the report
  bool distributed;         ///< false: runs on one rank without communication
  /// Expected traffic for `model` (built from the same config) on `world` ranks, training as `train` says.
  std::function<Theory(const Model& model, int world, const StrategyOptions&, const TrainConfig& train)> theory;
  /// Builds the runner on `world` (null when !distributed); a strategy makes the groups it needs from it (every
  /// strategy but hsdp: world->world()).
  std::function<std::unique_ptr<StepRunner>(const TrainConfig&, const StrategyOptions&, World*)> make;
  /// How each rank builds the model, for the report: "sharded" (unit by unit, Note [Sharded construction]), or
  /// "whole: " and why this strategy cannot do otherwise.
  std::string construction;
};

/// hsdp's mesh on `world` ranks: --mesh RxS, or by default 2 replicas of world/2 shards when the world size is even
/// and at least 4 (a replica per machine of two, each sharded), else one replica of all ranks (FSDP).
/// @throws std::invalid_argument when --mesh does not have `world` ranks, naming both.
std::pair<int, int> mesh_shape(const StrategyOptions& s, int world);

/// Whether `strategy` shards its parameters (fsdp, fsdp_prefetch, hsdp): its memory figures are measured.
bool shards_parameters(const std::string& strategy);

/// Whether `strategy` takes --prefetch-depth and --prefetch-limit (fsdp_prefetch and hsdp).
bool prefetches(const std::string& strategy);

/// True when `strategy` can clip its gradients (--clip-norm): every one but overlap_optimizer, which steps each
/// bucket's parameters inside backward, before the whole gradient (and so its norm) exists.
bool clips(const std::string& strategy);

/// True when `strategy` can save and load checkpoints (--save, --resume): every one but overlap_optimizer, whose
/// per-parameter optimizers live inside its reducer.
bool checkpoints(const std::string& strategy);

/// Every strategy built so far, in course order.
const std::vector<Strategy>& strategies();
/// Their names.
std::vector<std::string> strategy_names();
/// The strategy called `name`. @throws std::invalid_argument listing the known ones.
const Strategy& find_strategy(const std::string& name);

}  // namespace shardlab::cli
