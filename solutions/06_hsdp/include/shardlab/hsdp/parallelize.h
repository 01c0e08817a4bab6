#pragma once
/// @file parallelize.h
/// The library's entry point, as torchtitan's `parallelize`: a model with units, a mesh, and small policies give
/// data parallelism of the mesh's shape. A mesh of R replicas × S shards gives
///  - DDP when S = 1 (stage 02's bucketed DDP over the R ranks: every rank holds the whole model);
///  - FSDP when R = 1 (stage 04's sharded units over the S ranks, with stage 05's prefetch);
///  - HSDP otherwise (stage 06: sharded within each row, all-reduced across the rows).
/// Every rank calls it alike; it broadcasts rank 0's state over the whole world, so every rank starts equal. Given a
/// ModelBuilder instead of a model, FSDP and HSDP build the model sharded, unit by unit, and broadcast nothing.
///
/// @code
///   auto world = shardlab::World::from_environment();       // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
///   shardlab::Mesh mesh(*world, /*replicate=*/2, /*shard=*/4);   // 2 machines of 4 ranks: HSDP
///   auto dp = shardlab::parallelize([&] { return std::make_shared<MyModel>(cfg, seed); }, mesh);  // sharded build
///   torch::optim::AdamW opt(dp->parameters(), torch::optim::AdamWOptions(1e-3));
///   for (...) { opt.zero_grad(); dp->loss(my_slice).backward(); opt.step(); }
/// @endcode

#include "shardlab/bucketed_ddp/auto_caps.h"
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/model/no_sync.h"
#include "shardlab/core/parallel/parallel_model.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/fsdp/gather.h"
#include "shardlab/hsdp/hsdp_reducer.h"
#include "shardlab/prefetch/prefetch_policy.h"

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

/// What each rank of a shard group (the mesh's S ranks) holds only its share of: ZeRO's stages, FSDP2 the last. On a
/// mesh with S = 1 a share is the whole, and every rank holds everything (DDP) whatever this says.
enum class Sharding {
  kParameters,      ///< parameters, gradients and optimizer state (FSDP, ZeRO-3): stages 04-06
  kGradients,       ///< gradients and optimizer state, parameters replicated (ZeRO-2): stage 07, not built yet
  kOptimizerState,  ///< optimizer state only (ZeRO-1): stage 07, not built yet
};

/// When the sharded units give their gathered parameters back (FSDP2's reshard_after_forward).
struct ReshardPolicy {
  bool after_forward = true;  ///< free each unit after its forward, gather it again for its backward (FSDP2's default)
};

/// Makes the reducer of DDP's buckets on `group` (the mesh's replicate group): stage 03's hooks, or your own.
using BucketReducerFactory = std::function<bucketed_ddp::BucketReducer(Communicator& group)>;

/// DDP's buckets (a mesh with S = 1): their caps, how they are reduced, and whether the caps are tuned.
struct BucketPolicy {
  bucketed_ddp::BucketCaps caps;  ///< the first bucket's cap and the later ones' (PyTorch DDP's: 1 MiB, 25 MiB)
  /// True: after the second step the caps are chosen from a measured cost model (stage 02's AutoCaps, offered as
  /// the facets StepSeam and bucketed_ddp::AutoCaps; the loop calls the seam after every optimizer step).
  bool auto_caps = false;
  /// The buckets' reducer (stage 03's make_hook through as_bucket_reducer, hook_then_optimizer, or your own); null:
  /// the reduction's wire (an average in the gradients' dtype, or stage 03's fp16/bf16 hook).
  BucketReducerFactory reducer;
};

/// How gradients are reduced.
struct ReductionPolicy {
  /// The dtype on the wire: the reduce dtype, or fp16/bf16 compression (both groups under HSDP; stage 03's hook of
  /// that name under DDP, unless BucketPolicy::reducer says otherwise).
  Wire wire = Wire::kReduceDtype;
  /// False: a trainable parameter without a gradient in a step is an error (as FSDP's and DDP's default).
  bool allow_unused_parameters = false;
};

/// Where the sharded units' buffers come from.
struct BufferPolicy {
  /// True: on CPU, the all-gather and reduce-scatter buffers are reused from a pool (fsdp::Options::pool_buffers);
  /// false, or on CUDA: the device's allocator.
  bool pool = true;
};

/// Everything parallelize() takes besides the model and the mesh: the library's one vocabulary, which it turns into
/// the stages' options (bucketed_ddp::Options, fsdp::Options, prefetch). Each part has FSDP2's or DDP's default (the
/// buffers: shardlab's).
struct ParallelPolicy {
  Sharding sharding = Sharding::kParameters;  ///< what a shard group shares out (S > 1)
  fsdp::MixedPrecision mixed_precision;       ///< param and reduce dtypes of the sharded units (none: the parameters')
  ReshardPolicy reshard;                      ///< the sharded units' reshard after forward
  /// The sharded units' all-gathers issued ahead (depth 1 each way by default); none: each unit gathers when it is
  /// used (stage 04 alone).
  std::optional<prefetch::PrefetchPolicy> prefetch = prefetch::PrefetchPolicy{};
  /// How the sharded units' all-gathers pack and unpack their shards (stage 04's gather seam: a compressed
  /// all-gather of your own); null: the shards in the param dtype.
  std::shared_ptr<const fsdp::GatherSeam> gather;
  BucketPolicy buckets;       ///< DDP's buckets (S = 1)
  ReductionPolicy reduction;  ///< the gradients' wire and unused parameters
  BufferPolicy buffers;       ///< the sharded units' buffers: pooled or not
};

/// A model trained data-parallel on a mesh: what parallelize() returns. A ParallelModel (parallel_model.h) that
/// hands every call to the wrapper the mesh's shape gave, so a training loop holds a `ParallelModel&` whatever the
/// shape, and offers that wrapper's facets (Note [Facets, not downcasts]):
///  - DDP (S = 1): bucketed_ddp::BucketedDDP, its buckets; with BucketPolicy::auto_caps, bucketed_ddp::AutoCaps (what
///    it chose) and StepSeam (when it chooses);
///  - FSDP and HSDP (S > 1): MemoryFacet, the measured memory beside its theory, and ReplicaSync, the all-reduce
///    across replicas deferred for accumulation. On one replica (R = 1) there is no all-reduce: deferring then
///    reduce-scatters every micro-batch and keeps the rows (one row per unit, where no_sync keeps the unsharded
///    gradients), and the step's gradients are the same.
/// Owns the wrapper, shares the model and the mesh. Every collective is over the wrapper's groups: construction,
/// checkpoints and clipping over the whole mesh.
class DataParallel : public ParallelModel {
 public:
  /// Wraps `wrapper`, which trains `model` on `mesh`; adopts its facets. @throws InternalError for a null wrapper.
  DataParallel(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh, std::unique_ptr<ParallelModel> wrapper);
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // ParallelModel, as the wrapper answers it (BucketedDDP's or FullyShardedModel's contract): parameters() are the
  // replica's trainable parameters (DDP) or this rank's shards (FSDP, HSDP); full_*() gather under FSDP and HSDP;
  // clip_grad_norm runs no collective under DDP and one all-reduce over the shard group otherwise (replicas counted
  // once); checkpoints are written by DDP's rank 0, by FSDP's ranks each their rows, under HSDP by the first
  // replica's ranks, and any wrapper at any mesh shape loads them.
  at::Tensor loss(const Batch& batch) override { return wrapper_->loss(batch); }
  [[nodiscard]] NoSync no_sync() override { return wrapper_->no_sync(); }
  std::vector<at::Tensor> parameters() const override { return wrapper_->parameters(); }
  void visit_full_parameters(const std::function<void(size_t index, const at::Tensor& full)>& visit) override {
    wrapper_->visit_full_parameters(visit);
  }
  std::vector<at::Tensor> full_parameters() override { return wrapper_->full_parameters(); }
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override { return wrapper_->full_state_dict(); }
  double clip_grad_norm(double max_norm, double p = 2.0) override { return wrapper_->clip_grad_norm(max_norm, p); }
  void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                       const std::map<std::string, std::string>& metadata = {}) override {
    wrapper_->save_checkpoint(dir, optimizer, metadata);
  }
  std::map<std::string, std::string> load_checkpoint(const std::string& path, torch::optim::Optimizer* optimizer,
                                                     bool optimizer_if_saved = false,
                                                     const SavedNames& names = {}) override {
    return wrapper_->load_checkpoint(path, optimizer, optimizer_if_saved, names);
  }

 private:
  std::shared_ptr<Mesh> mesh_;  // first: the wrapper's groups outlive it
  std::shared_ptr<Model> model_;
  std::unique_ptr<ParallelModel> wrapper_;  // never null
};

/// Wraps `model` for data parallelism on `mesh` as its shape says (see the file comment), with `policy`. Every
/// rank of the mesh's world calls it alike; a collective over the whole world. The wrapper shares `mesh`, which
/// lives as long as either; the World it was made of must outlive both.
/// @throws std::invalid_argument before any collective: for a null model or mesh; under DDP (S = 1) for mixed
///         precision (bucketed DDP computes in the parameters' dtype) and for a bucket reducer beside a wire other
///         than the reduce dtype (two answers to one question) and for a gather seam (DDP gathers nothing); under
///         FSDP and HSDP (S > 1) for bucket caps, auto caps or a bucket reducer (they have no buckets), and for a
///         Sharding not built yet (ZeRO: stage 07). And as the wrapper's constructor does.
std::unique_ptr<DataParallel> parallelize(std::shared_ptr<Model> model, std::shared_ptr<Mesh> mesh,
                                          const ParallelPolicy& policy = {});
/// As above, on a mesh the caller keeps alive as long as the wrapper.
std::unique_ptr<DataParallel> parallelize(std::shared_ptr<Model> model, Mesh& mesh, const ParallelPolicy& policy = {});

/// parallelize for a model larger than one rank: the model is built by `build` inside the wrapper, and under FSDP
/// and HSDP each unit is sharded as the model registers it (FullyShardedModel's sharded construction), so no rank
/// ever holds the whole model, and nothing is broadcast: every rank's builder gives the same values (the same
/// seed). Under DDP (S = 1) the model is built whole, since every rank holds all of it anyway, and broadcast as the
/// other overload does. A collective over the whole world.
/// @param build makes the model on the CPU, each unit initialized before it registers it (model.h).
/// @param mesh R replicas x S shards: its shape picks DDP, FSDP or HSDP; shared as the other overload's.
/// @param policy as the other overload's.
/// @param device where the model's parameters go (each unit as it is built).
/// @throws as the other overload, and as FullyShardedModel's sharded construction.
std::unique_ptr<DataParallel> parallelize(const ModelBuilder& build, std::shared_ptr<Mesh> mesh,
                                          const ParallelPolicy& policy = {},
                                          const c10::Device& device = c10::Device(c10::kCPU));
/// As above, on a mesh the caller keeps alive as long as the wrapper.
std::unique_ptr<DataParallel> parallelize(const ModelBuilder& build, Mesh& mesh, const ParallelPolicy& policy = {},
                                          const c10::Device& device = c10::Device(c10::kCPU));

}  // namespace shardlab
