#include "strategies.h"

#include "runners.h"
#include "traffic.h"

#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/comm_hooks/optimizer_overlap.h"
#include "shardlab/core/device/device.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/parallel/standard_facets.h"
#include "shardlab/course/data.h"
#include "shardlab/course/model_factory.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/hsdp/parallelize.h"
#include "shardlab/naive_ddp/naive_ddp.h"
#include "shardlab/prefetch/prefetch.h"

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

bucketed_ddp::Options ddp_options(const StrategyOptions& s, const std::string& model) {
  bucketed_ddp::Options o;
  o.caps = caps(s);
  o.find_unused_parameters = leaves_parameters_unused(model);
  return o;
}

// BucketedDDP's runner: plain, or with auto caps.
std::unique_ptr<StepRunner> bucketed_runner(const TrainConfig& c, const StrategyOptions& s, Communicator& comm,
                                            std::shared_ptr<Model> model, bucketed_ddp::Options options,
                                            std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped = nullptr) {
  auto ddp = std::make_unique<bucketed_ddp::BucketedDDP>(model, comm, std::move(options));
  if (s.auto_caps) return auto_caps_runner(c, model, std::move(ddp), comm, std::move(overlapped));
  return wrapped_runner(c, model, std::move(ddp), std::move(overlapped));
}

// A strategy that runs BucketedDDP with one of stage 03's hooks ("" = stage 02's plain all-reduce of the average).
Strategy bucketed(std::string name, std::string description, std::string hook, double scale,
                  std::string bytes_note = "") {
  return {std::move(name),
          std::move(description),
          in_buckets(false),
          [scale](const Model& m, int, const StrategyOptions& s, const TrainConfig&) {
            return per_bucket_all_reduce(m, s, scale);
          },
          [hook](const TrainConfig& c, const StrategyOptions& s, World* world) -> std::unique_ptr<StepRunner> {
            auto model = model_on_device(c);
            bucketed_ddp::Options options = ddp_options(s, c.model);
            if (!hook.empty())
              options.reducer = comm_hooks::as_bucket_reducer(comm_hooks::make_hook(hook, world->world()));
            return bucketed_runner(c, s, world->world(), model, std::move(options));
          },
          kWholeReplica,
          std::move(bytes_note)};
}

// Bucketed DDP whose buckets step their own parameters as their averages land (stage 03's hook_then_optimizer):
// the same traffic as bucketed_ddp, no optimizer step after backward.
Strategy overlapped_optimizer() {
  return {"overlap_optimizer",
          "stage 03: buckets step their parameters as their averages land",
          in_buckets(true),
          [](const Model& m, int, const StrategyOptions& s, const TrainConfig&) {
            return per_bucket_all_reduce(m, s, 1.0);
          },
          [](const TrainConfig& c, const StrategyOptions& s, World* world) -> std::unique_ptr<StepRunner> {
            auto model = model_on_device(c);
            auto optimizer = std::make_shared<comm_hooks::OverlappedOptimizer>(
                trainable_parameters(*model),
                [&c](std::vector<at::Tensor> p) { return make_optimizer(c.optimizer, std::move(p), c.lr); });
            bucketed_ddp::Options options = ddp_options(s, c.model);
            options.reducer = comm_hooks::hook_then_optimizer(nullptr, optimizer);
            return bucketed_runner(c, s, world->world(), model, std::move(options), optimizer);
          },
          kWholeReplica,
          ""};
}

fsdp::Options fsdp_options(const StrategyOptions& s, const std::string& model) {
  fsdp::Options o;
  o.reshard_after_forward = s.reshard_after_forward;
  o.pool_buffers = s.pool_buffers;
  if (!s.param_dtype.empty()) o.mixed_precision.param_dtype = fsdp::parse_dtype(s.param_dtype);
  if (!s.reduce_dtype.empty()) o.mixed_precision.reduce_dtype = fsdp::parse_dtype(s.reduce_dtype);
  o.allow_unused_parameters = leaves_parameters_unused(model);
  return o;
}

// Stage 05: FSDP with the next units' all-gathers issued ahead (--prefetch-depth, --prefetch-limit). The same
// collectives as fsdp, so the same traffic.
prefetch::PrefetchPolicy prefetch_policy(const StrategyOptions& s) {
  prefetch::PrefetchPolicy policy;
  policy.forward_depth = s.prefetch_depth;
  policy.backward_depth = s.prefetch_depth;
  policy.max_in_flight = s.prefetch_limit;
  return policy;
}

// Stage 04's FSDP, built sharded; with stage 05's prefetch when `prefetch`.
std::unique_ptr<StepRunner> fsdp_runner(const TrainConfig& c, const StrategyOptions& s, World* world, bool prefetch) {
  std::shared_ptr<Model> model;
  auto wrapper = std::make_unique<fsdp::FullyShardedModel>(sharded_builder(c, model), world->world(),
                                                           fsdp_options(s, c.model), parse_device(c.device));
  if (prefetch) prefetch::enable_prefetch(*wrapper, prefetch_policy(s));
  return wrapped_runner(c, model, std::move(wrapper));
}

// Stage 06, the library: parallelize() on the mesh of mesh_shape() (S > 1: check_run_options refuses an Rx1 mesh,
// which parallelize makes DDP), HSDP with stage 05's prefetch inside each replica (FSDP for a 1xS mesh). Micro-batches
// before the last run under no_sync, or with the all-reduce across replicas deferred (--defer-all-reduce true).
std::unique_ptr<StepRunner> hsdp_runner(const TrainConfig& c, const StrategyOptions& s, World* world) {
  const auto [replicas, shards] = mesh_shape(s, world->size());
  const fsdp::Options units = fsdp_options(s, c.model);
  ParallelPolicy policy;
  policy.mixed_precision = units.mixed_precision;
  policy.reshard.after_forward = units.reshard_after_forward;
  policy.prefetch = prefetch_policy(s);
  policy.reduction.allow_unused_parameters = units.allow_unused_parameters;
  policy.buffers.pool = units.pool_buffers;
  std::shared_ptr<Model> model;
  auto dp = parallelize(sharded_builder(c, model), std::make_shared<Mesh>(*world, replicas, shards), policy,
                        parse_device(c.device));
  MicroBatchHook accumulation;
  if (s.defer_all_reduce) {  // on a 1xS mesh too: every micro-batch reduce-scattered, as hsdp_traffic counts
    ReplicaSync* sync = dp->facet<ReplicaSync>();  // S > 1: the hybrid wrapper's, R = 1 or not
    SHARDLAB_INTERNAL_ASSERT(sync != nullptr, "parallelize gave no ReplicaSync on a mesh with S > 1");
    accumulation = [sync](bool last) { sync->set_requires_all_reduce(last); };
  }
  return wrapped_runner(c, model, std::move(dp), nullptr, std::move(accumulation));
}

}  // namespace

const std::vector<Strategy>& strategies() {
  static const std::vector<Strategy> all{
      {"single", "one device, whole global batch (the reference)", one_device(),
       [](const Model&, int, const StrategyOptions&, const TrainConfig&) { return Theory{}; },
       [](const TrainConfig& c, const StrategyOptions&, World*) -> std::unique_ptr<StepRunner> {
         auto model = model_on_device(c);
         return wrapped_runner(c, model, single_device(model));
       },
       "whole: one device holds the model", ""},
      {"naive_ddp", "stage 01: one all-reduce per parameter gradient", Capabilities{},
       [](const Model& m, int, const StrategyOptions&, const TrainConfig&) { return per_parameter_all_reduce(m); },
       [](const TrainConfig& c, const StrategyOptions&, World* world) -> std::unique_ptr<StepRunner> {
         auto model = model_on_device(c);
         return wrapped_runner(c, model, std::make_unique<naive_ddp::NaiveDDP>(model, world->world()));
       },
       kWholeReplica, ""},
      bucketed("bucketed_ddp", "stage 02: flat buckets, async all-reduce overlapped with backward", "", 1.0),
      bucketed("hook_allreduce", "stage 03: buckets through the fp32 hook (pre/post divide)", "allreduce", 1.0),
      bucketed("hook_fp16", "stage 03: buckets compressed to fp16 on the wire", "fp16", 0.5),
      bucketed("hook_bf16", "stage 03: buckets compressed to bf16 (Gloo 1.13: sent as f32)", "bf16", 0.5,
               "the backend cannot reduce bf16 and sent it as f32: Gloo 1.13, see Note [Fallbacks]"),
      overlapped_optimizer(),
      {"fsdp", "stage 04: sharded units, all-gather before use, reduce-scatter of gradients", sharded(false, false),
       fsdp_traffic,
       [](const TrainConfig& c, const StrategyOptions& s, World* world) { return fsdp_runner(c, s, world, false); },
       "sharded", ""},
      {"fsdp_prefetch", "stage 05: FSDP with the next units' all-gathers in flight while this unit computes",
       sharded(true, false), fsdp_traffic,
       [](const TrainConfig& c, const StrategyOptions& s, World* world) { return fsdp_runner(c, s, world, true); },
       "sharded", ""},
      {"hsdp", "stage 06: sharded within each replica of an RxS mesh, all-reduced across replicas (--mesh)",
       sharded(true, true), hsdp_traffic, hsdp_runner, "sharded", ""},
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
