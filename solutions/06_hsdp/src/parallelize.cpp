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

// S = 1: stage 02's bucketed DDP over the replicas (every rank, since S = 1).
std::unique_ptr<DataParallel> replicated(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh,
                                         const ParallelPolicy& policy) {
  bucketed_ddp::Options options;
  options.find_unused_parameters = policy.reduction.allow_unused_parameters;
  if (policy.reduction.wire != Wire::kReduceDtype) {
    const std::string hook = wire_name(policy.reduction.wire);
    options.reducer = comm_hooks::as_bucket_reducer(comm_hooks::make_hook(hook, mesh->replicate_group()));
  }
  auto ddp = std::make_unique<bucketed_ddp::BucketedDDP>(model, mesh->replicate_group(), std::move(options));
  return std::make_unique<DataParallel>(std::move(model), std::move(mesh), std::move(ddp));
}

void check_policy(const Mesh& mesh, const ParallelPolicy& policy) {
  if (mesh.shard_size() == 1 && (policy.mixed_precision.param_dtype || policy.mixed_precision.reduce_dtype))
    throw std::invalid_argument("parallelize: a " + mesh.to_string() +
                                " mesh (shard size 1) gives DDP, which computes and reduces in the parameters' "
                                "dtype; expected no mixed precision, or a mesh with S > 1 (FSDP or HSDP)");
}

// S > 1: FSDP (R = 1: no all-reduce at all) or HSDP.
fsdp::Options sharded_options(const ParallelPolicy& policy) {
  fsdp::Options options;
  options.mixed_precision = policy.mixed_precision;
  options.reshard_after_forward = policy.reshard.after_forward;
  options.allow_unused_parameters = policy.reduction.allow_unused_parameters;
  options.pool_buffers = policy.buffers.pool;
  return options;
}

}  // namespace

std::unique_ptr<DataParallel> parallelize(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh,
                                          const ParallelPolicy& policy) {
  if (!model) throw std::invalid_argument("parallelize: expected a model; got null");
  if (!mesh) throw std::invalid_argument("parallelize: expected a mesh; got null");
  check_policy(*mesh, policy);
  if (mesh->shard_size() == 1) return replicated(std::move(model), std::move(mesh), policy);
  auto sharded = hsdp::fully_shard_hybrid(model, *mesh, sharded_options(policy), policy.reduction.wire);
  prefetch::enable_prefetch(*sharded, policy.prefetch);
  return std::make_unique<DataParallel>(std::move(model), std::move(mesh), std::move(sharded));
}

std::unique_ptr<DataParallel> parallelize(std::shared_ptr<Model> model, Mesh& mesh, const ParallelPolicy& policy) {
  return parallelize(std::move(model), borrowed(mesh), policy);
}

std::unique_ptr<DataParallel> parallelize(const ModelBuilder& build, std::shared_ptr<Mesh> mesh,
                                          const ParallelPolicy& policy, const c10::Device& device) {
  if (!build) throw std::invalid_argument("parallelize: expected a model builder; got an empty function");
  if (!mesh) throw std::invalid_argument("parallelize: expected a mesh; got null");
  check_policy(*mesh, policy);
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
  auto sharded = hsdp::fully_shard_hybrid(keep, *mesh, sharded_options(policy), policy.reduction.wire, device);
  prefetch::enable_prefetch(*sharded, policy.prefetch);
  return std::make_unique<DataParallel>(std::move(model), std::move(mesh), std::move(sharded));
}

std::unique_ptr<DataParallel> parallelize(const ModelBuilder& build, Mesh& mesh, const ParallelPolicy& policy,
                                          const c10::Device& device) {
  return parallelize(build, borrowed(mesh), policy, device);
}

}  // namespace shardlab
