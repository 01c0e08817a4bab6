#include "strategies.h"

#include "runners.h"
#include "traffic.h"

#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/comm_hooks/optimizer_overlap.h"
#include "shardlab/core/device/device.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/parallel/standard_facets.h"
#include "shardlab/course/data.h"
#include "shardlab/course/model_factory.h"
#include "shardlab/hsdp/parallelize.h"
#include "shardlab/naive_ddp/naive_ddp.h"

#include <ATen/ATen.h>

#include <map>
#include <stdexcept>

namespace shardlab::cli {
namespace {

// Model `c.model` on `c.device` (an index the worker has already resolved for this rank).
std::shared_ptr<Model> model_on_device(const TrainConfig& c) { return make_model(c, parse_device(c.device)); }

// What the sharded strategies give FSDP to build `c.model` unit by unit (Note [Sharded construction]): the model on
// the CPU, kept in `built` for the runner; FSDP moves each unit to the device as it shards it.
ModelBuilder sharded_builder(const TrainConfig& c, std::shared_ptr<Model>& built) {
  return [&c, &built] { return built = make_model(c, at::kCPU); };
}

// Why the replicated strategies build the whole model (Strategy::construction).
const char* const kWholeReplica = "whole: every rank keeps a full replica (DDP), built, then rank 0's state broadcast";

// The entries' capabilities (Strategy::can).
Capabilities one_device() {
  Capabilities c;
  c.communicates = false;
  return c;
}
Capabilities in_buckets(bool steps_in_backward) {
  Capabilities c;
  c.buckets = true;
  c.steps_in_backward = steps_in_backward;
  return c;
}
Capabilities sharded(bool prefetches, bool mesh) {
  Capabilities c;
  c.shards = true;
  c.prefetches = prefetches;
  c.mesh = mesh;
  return c;
}

// The meshes: every rank a replica (DDP), one replica of every rank (FSDP), or --mesh (HSDP).
std::pair<int, int> replicas(const StrategyOptions&, int world) { return {world, 1}; }
std::pair<int, int> shards(const StrategyOptions&, int world) { return {1, world}; }

// The policy of a strategy on buckets: the caps (auto too) and stage 03's hook `hook` ("" = stage 02's plain
// all-reduce of the average).
ParallelPolicy bucket_policy(const TrainConfig& c, const StrategyOptions& s, const std::string& hook) {
  ParallelPolicy policy;
  policy.buckets.caps = caps(s);
  policy.buckets.auto_caps = s.auto_caps;
  if (!hook.empty())
    policy.buckets.reducer = [hook](Communicator& group) {
      return comm_hooks::as_bucket_reducer(comm_hooks::make_hook(hook, group));
    };
  policy.reduction.allow_unused_parameters = leaves_parameters_unused(c.model);
  return policy;
}

// A strategy that runs bucketed DDP through parallelize() with one of stage 03's hooks.
Strategy bucketed(std::string name, std::string description, std::string hook, double scale,
                  std::string bytes_note = "") {
  Strategy s;
  s.name = std::move(name);
  s.description = std::move(description);
  s.can = in_buckets(false);
  s.theory = [scale](const Model& m, int, const StrategyOptions& o, const TrainConfig&) {
    return per_bucket_all_reduce(m, o, scale);
  };
  s.mesh = replicas;
  s.policy = [hook](const TrainConfig& c, const StrategyOptions& o) { return bucket_policy(c, o, hook); };
  s.construction = kWholeReplica;
  s.bytes_note = std::move(bytes_note);
  return s;
}

// Bucketed DDP whose buckets step their own parameters as their averages land (stage 03's hook_then_optimizer,
// which make_runner puts in as the buckets' reducer for a strategy that steps in backward): the same traffic as
// bucketed_ddp, no optimizer step after backward.
Strategy overlapped_optimizer() {
  Strategy s = bucketed("overlap_optimizer", "stage 03: buckets step their parameters as their averages land", "", 1.0);
  s.can = in_buckets(true);
  return s;
}

// The policy of the sharded strategies: stage 04's units (mixed precision, reshard, buffers) with stage 05's
// prefetch when `prefetch` (--prefetch-depth, --prefetch-limit).
ParallelPolicy sharded_policy(const TrainConfig& c, const StrategyOptions& s, bool prefetch) {
  ParallelPolicy policy;
  if (!s.param_dtype.empty()) policy.mixed_precision.param_dtype = fsdp::parse_dtype(s.param_dtype);
  if (!s.reduce_dtype.empty()) policy.mixed_precision.reduce_dtype = fsdp::parse_dtype(s.reduce_dtype);
  policy.reshard.after_forward = s.reshard_after_forward;
  policy.prefetch.reset();
  if (prefetch) {
    prefetch::PrefetchPolicy ahead;
    ahead.forward_depth = s.prefetch_depth;
    ahead.backward_depth = s.prefetch_depth;
    ahead.max_in_flight = s.prefetch_limit;
    policy.prefetch = ahead;
  }
  policy.reduction.allow_unused_parameters = leaves_parameters_unused(c.model);
  policy.buffers.pool = s.pool_buffers;
  return policy;
}

// A strategy that shards through parallelize() on the mesh `mesh` gives.
Strategy sharded_strategy(std::string name, std::string description, Capabilities can,
                          decltype(Strategy::theory) theory, decltype(Strategy::mesh) mesh) {
  Strategy s;
  s.name = std::move(name);
  s.description = std::move(description);
  s.can = can;
  s.theory = std::move(theory);
  s.mesh = std::move(mesh);
  s.policy = [prefetches = can.prefetches](const TrainConfig& c, const StrategyOptions& o) {
    return sharded_policy(c, o, prefetches);
  };
  s.construction = "sharded";
  return s;
}

// A named exception: a runner of its own.
Strategy exception(std::string name, std::string description, Capabilities can, decltype(Strategy::theory) theory,
                   RunnerFactory make, std::string construction) {
  Strategy s;
  s.name = std::move(name);
  s.description = std::move(description);
  s.can = can;
  s.theory = std::move(theory);
  s.make = std::move(make);
  s.construction = std::move(construction);
  return s;
}

}  // namespace

std::unique_ptr<StepRunner> make_runner(const Strategy& strategy, const TrainConfig& c, const StrategyOptions& s,
                                        World* world) {
  if (strategy.make) return strategy.make(c, s, world);
  SHARDLAB_INTERNAL_ASSERT(world != nullptr && strategy.mesh && strategy.policy,
                           "strategy " + strategy.name + ": neither a factory of its own nor a mesh and a policy");
  const auto [r, sh] = strategy.mesh(s, world->size());
  SHARDLAB_INTERNAL_ASSERT(!strategy.can.shards || sh >= 2, "strategy " + strategy.name + " shards, on a " +
                                                                std::to_string(r) + "x" + std::to_string(sh) +
                                                                " mesh (check_run_options refuses S < 2)");
  auto mesh = std::make_shared<Mesh>(*world, r, sh);
  ParallelPolicy policy = strategy.policy(c, s);
  std::shared_ptr<Model> model;
  std::unique_ptr<DataParallel> dp;
  std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped;
  if (sh == 1) {  // DDP: every rank holds the whole model
    model = model_on_device(c);
    if (strategy.can.steps_in_backward) {
      overlapped = std::make_shared<comm_hooks::OverlappedOptimizer>(
          trainable_parameters(*model),
          [&c](std::vector<at::Tensor> p) { return make_optimizer(c.optimizer, std::move(p), c.lr); });
      policy.buckets.reducer = [overlapped](Communicator&) {
        return comm_hooks::hook_then_optimizer(nullptr, overlapped);
      };
    }
    dp = parallelize(model, std::move(mesh), policy);
  } else {
    SHARDLAB_INTERNAL_ASSERT(!strategy.can.steps_in_backward, "an optimizer in backward on a sharded mesh");
    dp = parallelize(sharded_builder(c, model), std::move(mesh), policy, parse_device(c.device));
  }
  MicroBatchHook accumulation;
  if (s.defer_all_reduce) {  // on a 1xS mesh too: every micro-batch reduce-scattered, as hsdp_traffic counts
    ReplicaSync* sync = dp->facet<ReplicaSync>();  // check_run_options allows it only on a mesh with S > 1
    SHARDLAB_INTERNAL_ASSERT(sync != nullptr, "parallelize gave no ReplicaSync for --defer-all-reduce");
    accumulation = [sync](bool last) { sync->set_requires_all_reduce(last); };
  }
  return wrapped_runner(c, model, std::move(dp), std::move(overlapped), std::move(accumulation));
}

const std::vector<Strategy>& strategies() {
  static const std::vector<Strategy> all{
      exception(
          "single", "one device, whole global batch (the reference)", one_device(),
          [](const Model&, int, const StrategyOptions&, const TrainConfig&) { return Theory{}; },
          [](const TrainConfig& c, const StrategyOptions&, World*) -> std::unique_ptr<StepRunner> {
            auto model = model_on_device(c);
            return wrapped_runner(c, model, single_device(model));
          },
          "whole: one device holds the model"),
      exception(
          "naive_ddp", "stage 01: one all-reduce per parameter gradient", Capabilities{},
          [](const Model& m, int, const StrategyOptions&, const TrainConfig&) { return per_parameter_all_reduce(m); },
          [](const TrainConfig& c, const StrategyOptions&, World* world) -> std::unique_ptr<StepRunner> {
            auto model = model_on_device(c);
            return wrapped_runner(c, model, std::make_unique<naive_ddp::NaiveDDP>(model, world->world()));
          },
          kWholeReplica),
      bucketed("bucketed_ddp", "stage 02: flat buckets, async all-reduce overlapped with backward", "", 1.0),
      bucketed("hook_allreduce", "stage 03: buckets through the fp32 hook (pre/post divide)", "allreduce", 1.0),
      bucketed("hook_fp16", "stage 03: buckets compressed to fp16 on the wire", "fp16", 0.5),
      bucketed("hook_bf16", "stage 03: buckets compressed to bf16 (Gloo 1.13: sent as f32)", "bf16", 0.5,
               "the backend cannot reduce bf16 and sent it as f32: Gloo 1.13, see Note [Fallbacks]"),
      overlapped_optimizer(),
      sharded_strategy("fsdp", "stage 04: sharded units, all-gather before use, reduce-scatter of gradients",
                       sharded(false, false), fsdp_traffic, shards),
      sharded_strategy("fsdp_prefetch",
                       "stage 05: FSDP with the next units' all-gathers in flight while this unit computes",
                       sharded(true, false), fsdp_traffic, shards),
      sharded_strategy("hsdp",
                       "stage 06: sharded within each replica of an RxS mesh, all-reduced across replicas (--mesh)",
                       sharded(true, true), hsdp_traffic, mesh_shape),
  };
  return all;
}

std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (const auto& s : strategies()) names.push_back(s.name);
  return names;
}

std::string group_role(const std::string& group_name) { return group_name.substr(0, group_name.find('(')); }

std::pair<int, int> mesh_shape(const StrategyOptions& s, int world) {
  if (s.mesh.empty()) return world % 2 == 0 && world >= 4 ? std::pair{2, world / 2} : std::pair{1, world};
  const auto [replicas, shards] = Mesh::parse(s.mesh);
  if (replicas * shards != world)
    throw std::invalid_argument("--mesh " + s.mesh + " has " + std::to_string(replicas * shards) +
                                " ranks; the world size is " + std::to_string(world));
  return {replicas, shards};
}

std::string strategies_that(bool Capabilities::*capability) {
  std::vector<std::string> names;
  for (const auto& s : strategies())
    if (s.can.*capability) names.push_back(s.name);
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

Capabilities capabilities_of(const std::string& name) {
  for (const auto& s : strategies())
    if (s.name == name) return s.can;
  return {};
}

const Strategy& find_strategy(const std::string& name) {
  for (const auto& s : strategies())
    if (s.name == name) return s;
  std::string list;
  for (const auto& s : strategies()) list += (list.empty() ? "" : "|") + s.name;
  throw std::invalid_argument("unknown strategy '" + name + "'; expected one of " + list);
}

}  // namespace shardlab::cli
