#pragma once
// The strategies `shardlab train` and `shardlab compare` know. Extension point: a later stage adds one entry to
// strategies() in strategies.cpp, a Strategy: its name, a description, its Capabilities, a theory of its traffic, the
// mesh and the ParallelPolicy that parallelize() builds it from (or, for a demo the library does not offer, a factory
// of its own), how it builds the model, and (optionally) why its bytes may differ from theory.

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

namespace shardlab {
// parallelize.h's, forward-declared: it pulls in every stage's headers, and a stage's starter (tools/check-starter)
// recompiles every tool source that includes them; only strategies.cpp needs its definition.
struct ParallelPolicy;
}  // namespace shardlab

namespace shardlab::cli {

/// Bytes per rank of parameters and gradients, measured beside theory (0: not reported).
struct MemoryFigures {
  double peak_param_bytes = 0;
  double peak_param_bytes_theory = 0;
  double peak_grad_bytes = 0;
  double peak_grad_bytes_theory = 0;
};

/// --bucket-cap-kb auto: what rank 0 chose after step 2 and why (empty `caps` when the run chose nothing).
struct AutoCapsFigures {
  /// Chosen first and later cap (bytes), alpha (ns), beta (ns per byte), modelled exposed ns with the caps before
  /// and with the chosen ones: the report's "auto_caps".
  std::vector<double> caps;
  /// How many buckets the chosen caps make by the cap rule over the order the layout took.
  double buckets_theory = 0;
};

/// What StepRunner::visit_full_parameters calls with each parameter.
using ParameterVisitor = std::function<void(const at::Tensor& full)>;

/// Trains one rank's share: owns the model, its data-parallel wrapper and the optimizer.
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
  /// --bucket-cap-kb auto: what was chosen (nothing for every other runner).
  virtual AutoCapsFigures auto_caps() const { return {}; }
  /// The name and full sizes of every parameter visit_full_parameters visits, in its order.
  virtual std::vector<std::pair<std::string, std::vector<int64_t>>> full_parameter_shapes() const = 0;
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
  /// The same per group role, the part of a group's name before its ranks (group_role): "replicate" for the
  /// strategies on buckets, "shard" for FSDP, both for HSDP (the groups of the mesh parallelize() was given). Empty:
  /// everything on "world" (naive DDP).
  std::map<std::string, Traffic> groups;
};

/// The role of a group named by World: "shard(0,1)" -> "shard", "world" -> "world".
std::string group_role(const std::string& group_name);

/// What a strategy can do, and so which of the run's flags it takes. The tool asks these, never a strategy's
/// name: a new strategy is one entry in strategies().
struct Capabilities {
  bool communicates = true;        ///< false: one device, world size 1, no backend
  bool buckets = false;            ///< built on stage 02's buckets: --bucket-cap-kb (auto too), --first-bucket-kb
  bool shards = false;             ///< shards the parameters: its memory is measured, its buffers pooled or not
  bool prefetches = false;         ///< takes --prefetch-depth and --prefetch-limit
  bool mesh = false;               ///< runs on an RxS mesh: takes --mesh and --defer-all-reduce
  bool steps_in_backward = false;  ///< its optimizer steps inside backward: no --clip-norm, --save or --resume
  /// --clip-norm: the whole gradient exists before any parameter steps.
  bool clips() const { return !steps_in_backward; }
  /// --save and --resume: the optimizer's state is one optimizer a checkpoint can name.
  bool checkpoints() const { return !steps_in_backward; }
};

/// Builds a strategy's runner on `world` (null for one that does not communicate).
using RunnerFactory = std::function<std::unique_ptr<StepRunner>(const TrainConfig&, const StrategyOptions&, World*)>;

/// A named way to train: one entry of strategies(). A strategy of the library is a mesh rule and a policy, which
/// make_runner hands to parallelize(); a stage demo the library does not offer is a named exception with a factory
/// of its own.
struct Strategy {
  std::string name;         ///< the --strategy value
  std::string description;  ///< one line for the report
  Capabilities can;         ///< what it can do (which flags it takes)
  /// Expected traffic for `model` (built from the same config) on `world` ranks, training as `train` says.
  std::function<Theory(const Model& model, int world, const StrategyOptions&, const TrainConfig& train)> theory;
  /// The mesh parallelize() gets, R replicas x S shards, on `world` ranks: its shape picks DDP, FSDP or HSDP.
  std::function<std::pair<int, int>(const StrategyOptions&, int world)> mesh;
  /// What it asks of parallelize() (the library's vocabulary), from the run's options.
  std::function<ParallelPolicy(const TrainConfig&, const StrategyOptions&)> policy;
  /// A named exception (one device, stage 01's naive DDP): its own runner, not parallelize's; null otherwise.
  RunnerFactory make;
  /// How each rank builds the model, for the report: "sharded" (unit by unit, Note [Sharded construction]), or
  /// "whole: " and why this strategy cannot do otherwise.
  std::string construction;
  /// What the report says when the bytes measured differ from theory ("" for nothing): a known cause.
  std::string bytes_note;
};

/// Builds `strategy`'s runner for a rank of `world`: its own factory for a named exception, else parallelize() on
/// its mesh with its policy (the model built whole on the run's device for S = 1, unit by unit for S > 1), with the
/// optimizer stepping in backward when it can (stage 03's hook_then_optimizer as the buckets' reducer) and the
/// all-reduce across replicas deferred with --defer-all-reduce.
std::unique_ptr<StepRunner> make_runner(const Strategy& strategy, const TrainConfig& c, const StrategyOptions& s,
                                        World* world);

/// The mesh of a strategy on a mesh, on `world` ranks: --mesh RxS, or by default 2 replicas of world/2 shards when the
/// world size is even and at least 4 (a replica per machine of two, each sharded), else one replica of all ranks
/// (FSDP).
/// @throws std::invalid_argument when --mesh does not have `world` ranks, naming both.
std::pair<int, int> mesh_shape(const StrategyOptions& s, int world);

/// The names of the strategies that have `capability`, in course order, as a sentence lists them: "a", "a and b",
/// "a, b and c" (for messages that say which strategies take a flag).
std::string strategies_that(bool Capabilities::*capability);

/// Every strategy built so far, in course order.
const std::vector<Strategy>& strategies();
/// Their names.
std::vector<std::string> strategy_names();
/// What strategy `name` can do; for an unknown name (refused by --strategy's check, with the list), the defaults.
Capabilities capabilities_of(const std::string& name);
/// The strategy called `name`. @throws std::invalid_argument listing the known ones.
const Strategy& find_strategy(const std::string& name);

}  // namespace shardlab::cli
