#pragma once
/// @file parallel_model.h
/// What every data-parallel wrapper offers, whatever it does with the gradients: naive and bucketed DDP (a whole
/// replica on every rank), FSDP and HSDP (shards), and what parallelize() returns. Code that trains a model (a
/// training loop, the `shardlab` tool, a test that runs every strategy alike) holds a `ParallelModel&` and never
/// asks which wrapper it has; what only some wrappers have (measured memory, buckets, the all-reduce across
/// replicas, a step after the optimizer) it asks for as a facet (facets.h, standard_facets.h).
///
/// Vocabulary:
///  - *full*: as one device holds the model, unsharded, every parameter whole.
///  - *the step's parameters*: what the optimizer is built over and steps: a replica's trainable parameters, or
///    this rank's shards.

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/model/no_sync.h"
#include "shardlab/core/parallel/facets.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace shardlab {

/// A model trained data-parallel. Every method but parameters() is a collective where the wrapper communicates:
/// every rank of its group calls it alike, in the same order.
class ParallelModel {
 public:
  virtual ~ParallelModel() = default;

  /// The forward: the model's mean loss on this rank's `batch`. Call `.backward()` on it; after backward returns
  /// (outside no_sync) the gradients of the step's parameters are the mean over every rank's batch.
  virtual at::Tensor loss(const Batch& batch) = 0;
  /// Gradient accumulation: backward passes inside the scope keep their gradients local; the first one after it
  /// reduces them all.
  [[nodiscard]] virtual NoSync no_sync() = 0;
  /// The step's parameters (see the vocabulary), in a fixed order: build the optimizer over them.
  virtual std::vector<at::Tensor> parameters() const = 0;
  /// Calls `visit(i, full)` for every parameter i of the model in registration order, each full, one at a time (a
  /// sharded wrapper gathers one unit at a time). Read `full`, do not write it: a replicated wrapper hands its own
  /// parameter; copy it to keep it past the call.
  virtual void visit_full_parameters(const std::function<void(size_t index, const at::Tensor& full)>& visit) = 0;
  /// Every parameter of the model, full, in registration order: fresh tensors.
  virtual std::vector<at::Tensor> full_parameters() = 0;
  /// The model as one device holds it, named: PyTorch's state_dict() of the whole model (parameters in
  /// registration order, a tied weight under each of its names, then buffers), fresh tensors.
  virtual std::vector<std::pair<std::string, at::Tensor>> full_state_dict() = 0;
  /// Clips the gradients of the step's parameters by the whole model's p-norm, as PyTorch's clip_grad_norm_
  /// (grad_clip.h). Call it on every rank between backward and the optimizer's step.
  /// @return the total norm before clipping.
  virtual double clip_grad_norm(double max_norm, double p) = 0;
  /// Saves the model and `optimizer`'s state (null: the model only) as a sharded checkpoint in `dir`, replacing
  /// the one there atomically (training_state.h). Any wrapper at any world size loads it.
  /// @param dir the checkpoint's directory (on a filesystem every rank sees).
  /// @param optimizer built over parameters(); null to save the model only.
  /// @param metadata strings to keep with the checkpoint (rank 0's).
  virtual void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                               const std::map<std::string, std::string>& metadata) = 0;
  /// Loads a checkpoint saved by any wrapper at any world size (or a full safetensors file); all or nothing.
  /// @param path the checkpoint's directory, or a safetensors file.
  /// @param optimizer built over parameters(); null to load the model only.
  /// @param optimizer_if_saved true: a checkpoint of weights only loads the model and leaves `optimizer` as is.
  /// @param names the model's name of each saved tensor (checkpoint.h's SavedNames); empty: the saved names.
  /// @return the saved metadata.
  virtual std::map<std::string, std::string> load_checkpoint(const std::string& path,
                                                             torch::optim::Optimizer* optimizer,
                                                             bool optimizer_if_saved, const SavedNames& names) = 0;

  /// The facet F of this wrapper (facets.h), or null when it has none: a loop asks for what it uses, never which
  /// wrapper it holds. Valid as long as the wrapper.
  template <class F>
  F* facet() const {
    return facets_.get<F>();
  }
  /// The facet F of this wrapper, which the caller needs: `what` names it in the error.
  /// @throws std::invalid_argument naming `what` when the wrapper does not offer F.
  template <class F>
  F& required_facet(const std::string& what) const {
    F* part = facets_.get<F>();
    if (part == nullptr)
      throw std::invalid_argument("expected a wrapper that offers " + what + "; this one does not (it offers " +
                                  std::to_string(facets_.size()) + " facets: see what its class documents)");
    return *part;
  }
  /// Every facet this wrapper offers (a facade adopts those of the wrapper it holds when it is built).
  const Facets& facets() const { return facets_; }
  /// Adds facet F from outside the wrapper: an extension that works beside it (for example a StepSeam of an
  /// optimizer that shards its state). The wrapper keeps `part` alive. Call it before training, on every rank alike.
  template <class F>
  void attach(std::shared_ptr<F> part) {
    F* raw = part.get();
    facets_.add<F>(raw, std::move(part));
  }

 protected:
  /// What the wrapper offers: each wrapper registers its own parts in its constructor.
  Facets facets_;
};

/// A ParallelModel whose every rank holds the whole model (DDP, one device): it answers for the full model from its
/// own replica, with no collective.
class ReplicatedModel : public ParallelModel {
 public:
  /// The replica's trainable parameters (a tied weight once), registration order.
  std::vector<at::Tensor> parameters() const override;
  /// Every parameter of the replica, in registration order, on the replica's own tensors.
  void visit_full_parameters(const std::function<void(size_t index, const at::Tensor& full)>& visit) override;
  /// Copies of every parameter of the replica, registration order.
  std::vector<at::Tensor> full_parameters() override;
  /// Copies of the replica's state, named: its parameters (a tied weight under each of its names), then buffers.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;

 protected:
  /// The model this rank holds whole.
  virtual const Model& replica() const = 0;
};

}  // namespace shardlab
