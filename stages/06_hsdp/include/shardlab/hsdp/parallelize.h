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

#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/model/no_sync.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/hsdp/hsdp_reducer.h"
#include "shardlab/prefetch/prefetch_policy.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

/// When the sharded units give their gathered parameters back (FSDP2's reshard_after_forward).
struct ReshardPolicy {
  bool after_forward = true;  ///< free each unit after its forward, gather it again for its backward (FSDP2's default)
};

/// How gradients are reduced.
struct ReductionPolicy {
  /// The dtype on the wire: the reduce dtype, or fp16/bf16 compression (both groups under HSDP; stage 03's hook of
  /// that name under DDP).
  Wire wire = Wire::kReduceDtype;
  /// False: a trainable parameter without a gradient in a step is an error (as FSDP's and DDP's default).
  bool allow_unused_parameters = false;
};

/// Everything parallelize() takes besides the model and the mesh; each part has FSDP2's default.
struct ParallelPolicy {
  fsdp::MixedPrecision mixed_precision;  ///< param and reduce dtypes of the sharded units (none: the parameters')
  ReshardPolicy reshard;                 ///< the sharded units' reshard after forward
  prefetch::PrefetchPolicy prefetch;     ///< the sharded units' all-gathers issued ahead (depth 1 each way)
  ReductionPolicy reduction;             ///< the gradients' wire and unused parameters
};

/// A model trained data-parallel on a mesh: what parallelize() returns. Owns the wrapper and shares the model; the
/// mesh (and the World it was made of) must outlive it.
class DataParallel {
 public:
  /// Which wrapper the mesh's shape gave.
  enum class Kind { kDdp, kFsdp, kHsdp };

  /// Wraps a bucketed DDP (S = 1).
  DataParallel(std::shared_ptr<Model> model, Mesh& mesh, std::unique_ptr<bucketed_ddp::BucketedDDP> ddp);
  /// Wraps an FSDP (R = 1) or HSDP wrapper.
  DataParallel(std::shared_ptr<Model> model, Mesh& mesh, std::unique_ptr<fsdp::FullyShardedModel> sharded);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// DDP, FSDP or HSDP.
  Kind kind() const { return kind_; }
  /// "ddp", "fsdp" or "hsdp".
  std::string kind_name() const;
  /// The forward: the model's mean loss on this rank's slice. Call `backward()` on it; after backward returns
  /// (outside no_sync) the gradients are the mean over all ranks' slices.
  at::Tensor loss(const Batch& batch);
  /// Gradient accumulation: backward passes inside the scope keep their gradients local; the first one after it
  /// reduces them all.
  [[nodiscard]] NoSync no_sync();
  /// What the optimizer steps: the replica's trainable parameters (DDP), or this rank's shards (FSDP, HSDP).
  std::vector<at::Tensor> parameters();
  /// Every parameter of the model as one device holds it, registration order. A collective (FSDP and HSDP gather):
  /// every rank calls it.
  std::vector<at::Tensor> full_parameters();
  /// The model as one device holds it, named, as FullyShardedModel::full_state_dict (DDP: copies of the replica's
  /// tensors). A collective (FSDP and HSDP gather): every rank calls it.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict();
  /// Clips the gradients by the whole model's p-norm, as PyTorch's clip_grad_norm_ (grad_clip.h): DDP with no
  /// collective, FSDP and HSDP with one all-reduce over the shard group (replicas counted once). Call it on every
  /// rank between backward and the optimizer's step. @return the total norm before clipping.
  /// @throws as BucketedDDP::clip_grad_norm and FullyShardedModel::clip_grad_norm.
  double clip_grad_norm(double max_norm, double p = 2.0);
  /// Saves the model and `optimizer`'s state (null: the model only) as a sharded checkpoint in `dir`, replacing the
  /// one there atomically (training_state.h, checkpoint.h): DDP's rank 0 writes the replica; FSDP's ranks each
  /// write their rows; under HSDP the first replica's ranks write theirs (the other replicas hold the same). Any
  /// wrapper at any mesh shape loads it. A collective over the whole world, between steps.
  /// @param dir the checkpoint's directory (on a filesystem every rank sees).
  /// @param optimizer built over parameters(); null to save the model only.
  /// @param metadata strings to keep with the checkpoint (rank 0's).
  /// @throws as save_training_checkpoint, on every rank alike.
  void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                       const std::map<std::string, std::string>& metadata = {});
  /// Loads a checkpoint saved by any wrapper at any world size (or a full safetensors file); all or nothing. A
  /// collective over the whole world, between steps.
  /// @param path the checkpoint's directory, or a safetensors file.
  /// @param optimizer built over parameters(); null to load the model only.
  /// @param optimizer_if_saved true: a checkpoint of weights only (exported, or from PyTorch) loads the model and
  ///        leaves `optimizer` as it is (load_training_checkpoint).
  /// @param names the model's name of each saved tensor, for a file named otherwise (a Hugging Face file's dotted
  ///        names; checkpoint.h's SavedNames); empty: the saved names. A tied weight loads under any of its names.
  /// @return the saved metadata.
  /// @throws as load_training_checkpoint, on every rank alike, before anything changes.
  std::map<std::string, std::string> load_checkpoint(const std::string& path, torch::optim::Optimizer* optimizer,
                                                     bool optimizer_if_saved = false, const SavedNames& names = {});
  /// HSDP: defers (false) or restores (true) the all-reduce across replicas, for accumulation (see
  /// hsdp::set_requires_all_reduce). @throws std::invalid_argument for DDP and FSDP, which have no such all-reduce.
  void set_requires_all_reduce(bool requires_all_reduce);
  /// The FSDP or HSDP wrapper (null for DDP): its memory figures, units, observer.
  fsdp::FullyShardedModel* sharded() { return sharded_.get(); }
  /// The DDP wrapper (null for FSDP and HSDP): its buckets.
  bucketed_ddp::BucketedDDP* ddp() { return ddp_.get(); }
  /// The mesh it runs on.
  Mesh& mesh() { return mesh_; }

 private:
  std::shared_ptr<Model> model_;
  Mesh& mesh_;
  Kind kind_;
  std::unique_ptr<bucketed_ddp::BucketedDDP> ddp_;
  std::unique_ptr<fsdp::FullyShardedModel> sharded_;
};

/// Wraps `model` for data parallelism on `mesh` as its shape says (see the file comment), with `policy`. Every
/// rank of the mesh's world calls it alike; a collective over the whole world.
/// @throws std::invalid_argument for a null model, and for mixed precision under DDP (S = 1: bucketed DDP computes
///         in the parameters' dtype), before any collective; and as the wrapper's constructor does.
std::unique_ptr<DataParallel> parallelize(std::shared_ptr<Model> model, Mesh& mesh, const ParallelPolicy& policy = {});

/// parallelize for a model larger than one rank: the model is built by `build` inside the wrapper, and under FSDP
/// and HSDP each unit is sharded as the model registers it (FullyShardedModel's sharded construction), so no rank
/// ever holds the whole model, and nothing is broadcast: every rank's builder gives the same values (the same
/// seed). Under DDP (S = 1) the model is built whole, since every rank holds all of it anyway, and broadcast as the
/// other overload does. A collective over the whole world.
/// @param build makes the model on the CPU, each unit initialized before it registers it (model.h).
/// @param mesh R replicas x S shards: its shape picks DDP, FSDP or HSDP.
/// @param policy as the other overload's.
/// @param device where the model's parameters go (each unit as it is built).
/// @throws as the other overload, and as FullyShardedModel's sharded construction.
std::unique_ptr<DataParallel> parallelize(const ModelBuilder& build, Mesh& mesh, const ParallelPolicy& policy = {},
                                          const c10::Device& device = c10::Device(c10::kCPU));

}  // namespace shardlab
