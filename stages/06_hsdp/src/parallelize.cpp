#include "shardlab/hsdp/parallelize.h"

#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/core/errors.h"
#include "shardlab/hsdp/hsdp.h"
#include "shardlab/prefetch/prefetch.h"

#include "shardlab/core/comm/text_gather.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace shardlab {

DataParallel::DataParallel(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh,
                           std::unique_ptr<ParallelModel> wrapper)
    : mesh_(std::move(mesh)), model_(std::move(model)), wrapper_(std::move(wrapper)) {
  SHARDLAB_INTERNAL_ASSERT(wrapper_ != nullptr, "DataParallel: a null wrapper");
  facets_.adopt(wrapper_->facets());
}

DataParallel::~DataParallel() = default;

namespace {

// A mesh the caller keeps alive: shared without ownership.
std::shared_ptr<Mesh> borrowed(Mesh& mesh) { return {std::shared_ptr<Mesh>(), &mesh}; }

// S = 1: stage 02's bucketed DDP over the replicas (every rank, since S = 1), its options filled from the policy.
std::unique_ptr<DataParallel> replicated(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh,
                                         const ParallelPolicy& policy) {
  Communicator& group = mesh->replicate_group();
  bucketed_ddp::Options options;
  options.caps = policy.buckets.caps;
  options.find_unused_parameters = policy.reduction.allow_unused_parameters;
  if (policy.buckets.reducer)
    options.reducer = policy.buckets.reducer(group);
  else if (policy.reduction.wire != Wire::kReduceDtype)
    options.reducer = comm_hooks::as_bucket_reducer(comm_hooks::make_hook(wire_name(policy.reduction.wire), group));
  auto ddp = std::make_unique<bucketed_ddp::BucketedDDP>(model, group, std::move(options));
  std::shared_ptr<bucketed_ddp::AutoCaps> tuner;
  if (policy.buckets.auto_caps) tuner = std::make_shared<bucketed_ddp::AutoCaps>(*ddp, group);
  auto dp = std::make_unique<DataParallel>(std::move(model), std::move(mesh), std::move(ddp));
  if (tuner) {
    dp->attach<bucketed_ddp::AutoCaps>(tuner);
    dp->attach<StepSeam>(tuner);
  }
  return dp;
}

bool same_caps(const bucketed_ddp::BucketCaps& a, const bucketed_ddp::BucketCaps& b) {
  return a.first_bytes == b.first_bytes && a.bytes == b.bytes;
}

// Refuses, before any collective, what the mesh's shape cannot do with the policy.
void check_policy(const Mesh* mesh, const ParallelPolicy& policy) {
  if (!mesh) throw std::invalid_argument("parallelize: expected a mesh; got null");
  const std::string shape = "a " + mesh->to_string() + " mesh";
  if (mesh->shard_size() == 1) {
    if (policy.mixed_precision.param_dtype || policy.mixed_precision.reduce_dtype)
      throw std::invalid_argument("parallelize: " + shape +
                                  " (shard size 1) gives DDP, which computes and reduces in the parameters' dtype; "
                                  "expected no mixed precision, or a mesh with S > 1 (FSDP or HSDP)");
    if (policy.buckets.reducer && policy.reduction.wire != Wire::kReduceDtype)
      throw std::invalid_argument("parallelize: " + shape +
                                  " gives DDP, whose buckets the policy's bucket reducer reduces: it decides what "
                                  "goes on the wire; expected Wire::kReduceDtype beside it; got the wire " +
                                  wire_name(policy.reduction.wire));
    if (policy.gather)
      throw std::invalid_argument("parallelize: " + shape +
                                  " gives DDP, which gathers nothing: every rank holds the whole model; expected no "
                                  "gather seam, or a mesh with S > 1 (FSDP or HSDP)");
    return;
  }
  const bool buckets =
      !same_caps(policy.buckets.caps, bucketed_ddp::BucketCaps{}) || policy.buckets.auto_caps || policy.buckets.reducer;
  if (buckets)
    throw std::invalid_argument("parallelize: " + shape +
                                " (shard size > 1) gives FSDP or HSDP, which reduce unit by unit, not in buckets; "
                                "expected the default BucketPolicy, or a mesh with S = 1 (DDP)");
  if (policy.sharding == Sharding::kGradients || policy.sharding == Sharding::kOptimizerState)
    throw std::invalid_argument("parallelize: " + shape + ": sharding " +
                                (policy.sharding == Sharding::kGradients
                                     ? "the gradients and the optimizer state with the parameters replicated (ZeRO-2)"
                                     : "the optimizer state alone (ZeRO-1)") +
                                " is stage 07's, not built yet; expected Sharding::kParameters (FSDP, HSDP)");
}

// S > 1: FSDP (R = 1: no all-reduce at all) or HSDP, stage 04's options filled from the policy.
fsdp::Options sharded_options(const ParallelPolicy& policy) {
  fsdp::Options options;
  options.mixed_precision = policy.mixed_precision;
  options.reshard_after_forward = policy.reshard.after_forward;
  options.allow_unused_parameters = policy.reduction.allow_unused_parameters;
  options.pool_buffers = policy.buffers.pool;
  options.gather = policy.gather;
  return options;
}

// Stage 05's prefetch on the sharded units, when the policy asks for it.
std::unique_ptr<DataParallel> sharded(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh,
                                      std::unique_ptr<fsdp::FullyShardedModel> units, const ParallelPolicy& policy) {
  if (policy.prefetch) prefetch::enable_prefetch(*units, *policy.prefetch);
  return std::make_unique<DataParallel>(std::move(model), std::move(mesh), std::move(units));
}

}  // namespace

std::unique_ptr<DataParallel> parallelize(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh,
                                          const ParallelPolicy& policy) {
  if (!model) throw std::invalid_argument("parallelize: expected a model; got null");
  check_policy(mesh.get(), policy);
  if (mesh->shard_size() == 1) return replicated(std::move(model), std::move(mesh), policy);
  auto units = hsdp::fully_shard_hybrid(model, *mesh, sharded_options(policy), policy.reduction.wire);
  return sharded(std::move(model), std::move(mesh), std::move(units), policy);
}

std::unique_ptr<DataParallel> parallelize(std::shared_ptr<Model> model, Mesh& mesh, const ParallelPolicy& policy) {
  return parallelize(std::move(model), borrowed(mesh), policy);
}

std::unique_ptr<DataParallel> parallelize(const ModelBuilder& build, std::shared_ptr<Mesh> mesh,
                                          const ParallelPolicy& policy, const c10::Device& device) {
  if (!build) throw std::invalid_argument("parallelize: expected a model builder; got an empty function");
  check_policy(mesh.get(), policy);
  std::shared_ptr<Model> model;
  const ModelBuilder keep = [&] { return model = build(); };
  if (mesh->shard_size() == 1) {  // DDP holds the whole model on every rank: built whole, then broadcast as always
    run_agreed(mesh->world().world(), "parallelize: building the model", [&] {
      keep();
      if (!model) throw std::invalid_argument("parallelize: the model builder returned a null pointer");
      model->to(device);
    });
    return replicated(std::move(model), std::move(mesh), policy);
  }
  auto units = hsdp::fully_shard_hybrid(keep, *mesh, sharded_options(policy), policy.reduction.wire, device);
  return sharded(std::move(model), std::move(mesh), std::move(units), policy);
}

std::unique_ptr<DataParallel> parallelize(const ModelBuilder& build, Mesh& mesh, const ParallelPolicy& policy,
                                          const c10::Device& device) {
  return parallelize(build, borrowed(mesh), policy, device);
}

}  // namespace shardlab
