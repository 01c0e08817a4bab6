#pragma once
/// @file model.h
/// What a model is to shardlab (part of the core library): a torch::nn::Module with a mean loss over a Batch, split
/// into units that the wrappers shard. The shipped models (make_model) are in models.h, part of the course library.
///
/// Vocabulary: a *Batch* is a pair (input, target) whose dim 0 is the batch dimension; `step` is the training step
/// it belongs to (some test models use it to leave a parameter without gradient on odd steps).

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace shardlab {

/// A batch of examples; dim 0 of `input` and `target` is the batch dimension.
struct Batch {
  at::Tensor input;   ///< MLP/edge: [B, features] float; tiny_gpt: [B, T] int64 tokens
  at::Tensor target;  ///< MLP/edge: [B] int64 classes; tiny_gpt: [B, T] int64 next tokens
  int64_t step = 0;   ///< training step this batch belongs to
  /// Number of examples (dim 0).
  int64_t size() const { return input.size(0); }
  /// Examples [start, start + length) as a view.
  Batch slice(int64_t start, int64_t length) const;
  /// The same batch on `device` (no copy when it is already there).
  Batch to(const c10::Device& device) const;
};

/// What a model calls to run one unit: the unit's input to its output.
using UnitForward = std::function<at::Tensor(const at::Tensor&)>;

/// One *unit* of a model: a sub-module whose parameters are sharded and gathered together (a transformer block, an
/// MLP layer), called through a replaceable slot.
///
/// The model never calls the unit's module directly: it calls `forward`, which starts as the module's own forward.
/// A wrapper replaces `forward` with one that acts before and after the call (FSDP gathers the unit's parameters
/// before it and frees them after it). libtorch's Module has no forward hooks and a non-virtual forward; the slot
/// is the hook.
struct Unit {
  std::string name;                           ///< the sub-module's registered name ("block0"; libtorch refuses a
                                              ///< submodule name with a dot, so a unit's name has none)
  std::shared_ptr<torch::nn::Module> module;  ///< owns the unit's parameters (registered in the model too)
  UnitForward forward;                        ///< what the model calls; a wrapper may replace it
};

class Model;

/// What a wrapper does with each unit the moment the model registers it (see UnitBuildScope).
using UnitBuilt = std::function<void(Unit& unit)>;

/// Sharded construction, the hook: while a scope lives, every `Model::register_unit` on this thread calls the
/// scope's function with the unit it just registered, before register_unit returns. FSDP shards the unit there, so
/// that its full values are gone before the model builds the next one (Note [Building a model unit by unit] in
/// model.cpp). A model built this way must give each unit its initial values *before* registering it (Initializer
/// shows how). Thread-local: the model is built on the thread that made the scope, and every model built there
/// while the scope lives hands its units over (build only the one model inside a scope). Scopes do not nest.
class UnitBuildScope {
 public:
  /// Installs `on_unit` for this thread. @throws std::logic_error when a scope already lives on this thread.
  explicit UnitBuildScope(UnitBuilt on_unit);
  /// Uninstalls it.
  ~UnitBuildScope();
  UnitBuildScope(const UnitBuildScope&) = delete;
  UnitBuildScope& operator=(const UnitBuildScope&) = delete;
  /// Called by Model::register_unit: passes `unit` to this thread's scope, if one lives.
  static void unit_registered(Unit& unit);
};

/// Makes a model, on the CPU: what a wrapper's sharded construction calls once, inside its UnitBuildScope (FSDP's
/// FullyShardedModel(ModelBuilder, ...), parallelize). Every rank's builder must build the same structure with the
/// same values (the same seed): nothing is broadcast.
using ModelBuilder = std::function<std::shared_ptr<Model>()>;

/// A model's handle on one of its units: calling it runs the unit's current slot (see Unit); `->` reaches the
/// module. What `Model::register_unit` returns; a model keeps it where it kept the module.
template <typename M>
class UnitRef {
 public:
  UnitRef() = default;
  /// Runs the unit through its slot.
  at::Tensor operator()(const at::Tensor& x) const;
  /// The unit's module.
  M* operator->() const { return module_.get(); }
  /// The unit's module, shared.
  const std::shared_ptr<M>& module() const { return module_; }

 private:
  friend class Model;
  UnitRef(Model* model, size_t index, std::shared_ptr<M> module)
      : model_(model), index_(index), module_(std::move(module)) {}
  Model* model_ = nullptr;
  size_t index_ = 0;
  std::shared_ptr<M> module_;
};

/// A trainable model: a torch::nn::Module whose loss is the mean over the batch's examples (so averaging the
/// gradients of equal slices gives the gradient of the whole batch).
///
/// Units: a model may split itself into units (see Unit) by registering sub-modules with `register_unit` instead
/// of `register_module`, and calling them through the returned UnitRef. Parameters outside every unit form the
/// *root*. A parameter must belong to one unit at most (a tied weight is registered once, in one place: the tiny
/// GPT keeps its tied embedding in the root).
class Model : public torch::nn::Module {
 public:
  /// Mean loss over `batch` (scalar, requires grad).
  virtual at::Tensor loss(const Batch& batch) = 0;

  /// The units, in the order they were registered (the forward order for the shipped models). Empty: the whole
  /// model is its root. A wrapper may replace each unit's `forward`; it must not add or remove units.
  std::vector<Unit>& units() { return units_; }
  /// Read-only view of the units.
  const std::vector<Unit>& units() const { return units_; }

 protected:
  /// Registers `module` as sub-module `name` (as `register_module` does) and as the next unit, whose slot starts
  /// as `module->forward(x)`. One line per unit turns a user's model into one FSDP can shard:
  /// @code
  ///   blocks_.push_back(register_unit("block" + std::to_string(i), std::make_shared<Block>(...)));
  ///   ...  x = blocks_[i](x);      // instead of blocks_[i]->forward(x)
  /// @endcode
  /// Inside a UnitBuildScope (sharded construction) the unit is handed to the wrapper before this returns: give it
  /// its initial values first (Initializer), and never write to its parameters afterwards.
  /// @pre M has `at::Tensor forward(const at::Tensor&)`; `name` has no dot (libtorch's rule for submodules).
  template <typename M>
  UnitRef<M> register_unit(const std::string& name, std::shared_ptr<M> module) {
    register_module(name, module);
    M* raw = module.get();
    units_.push_back(Unit{name, module, [raw](const at::Tensor& x) { return raw->forward(x); }});
    UnitBuildScope::unit_registered(units_.back());  // sharded construction: the wrapper takes the unit now
    return UnitRef<M>(this, units_.size() - 1, std::move(module));
  }

 private:
  template <typename M>
  friend class UnitRef;
  std::vector<Unit> units_;
};

template <typename M>
at::Tensor UnitRef<M>::operator()(const at::Tensor& x) const {
  if (model_ == nullptr) throw std::logic_error("UnitRef: called before register_unit gave it a unit");
  return model_->units_[index_].forward(x);
}

/// Fills every parameter and buffer of `module` from a private generator seeded with `seed` (normal, std 0.02 for
/// matrices, zeros for biases, ones for norm weights), each tensor once (a tied weight at its first name). Used by
/// the models; exposed for tests that need ranks to start from different weights.
void init_parameters(torch::nn::Module& module, uint64_t seed);

/// init_parameters, drawn part by part as a model is built (Note [Building a model unit by unit] in model.cpp): one
/// private generator, each part filled by init_parameters' rule from the next draws. Filling the parts in the
/// order the finished model lists its parameters (libtorch lists a module's own parameters before its children's)
/// gives exactly what init_parameters(model, seed) gives; so a
/// model can fill each unit before registering it, as sharded construction needs, and still match one device.
class Initializer {
 public:
  /// A generator seeded with `seed`, as init_parameters seeds it.
  explicit Initializer(uint64_t seed);
  /// Fills `module`'s parameters, then its buffers, from the next draws; a tensor this initializer filled before (a
  /// tied weight's second name) is not drawn again.
  void fill(torch::nn::Module& module);
  /// fill(*module), then returns `module`: `register_unit("block0", init(std::make_shared<Block>(...)))`.
  template <typename M>
  std::shared_ptr<M> operator()(std::shared_ptr<M> module) {
    fill(*module);
    return module;
  }
  /// Fills what is left of the root: every parameter of `model` outside its units that this initializer has not
  /// filled yet, then every such buffer.
  void fill_root(Model& model);

 private:
  void fill_tensors(const std::vector<std::pair<std::string, at::Tensor>>& params,
                    const std::vector<at::Tensor>& buffers);
  at::Generator gen_;
  std::unordered_set<const void*> filled_;  // the tensors filled so far (TensorImpl)
  std::vector<at::Tensor> keep_;            // ... kept alive, so that no new tensor takes a filled one's address
};

/// Which of a module's tensors named_state lists.
enum class StateParts {
  kParametersAndBuffers,  ///< every parameter, then every buffer
  kParameters,            ///< the parameters only
  kBuffers,               ///< the buffers only (FSDP holds the parameters itself)
};

/// `module`'s tensors with their full names ("block0.fc.weight"), in registration order, undefined ones left out.
/// A tensor registered under two names (a tied weight) is listed under each, as PyTorch's state_dict() does, or,
/// with `once`, under its first name only, as a checkpoint saves it (a weight stored twice would load twice).
/// @param module the model.
/// @param parts the parameters and buffers, or the buffers only.
/// @param once list a tensor registered under several names once.
std::vector<std::pair<std::string, at::Tensor>> named_state(const torch::nn::Module& module, StateParts parts,
                                                            bool once);

/// Every later name of a tensor registered under several names (a tied weight: Hugging Face's GPT-2 registers its
/// token embedding as `lm_head.weight` too), mapped to its first name, the one named_state lists with `once`.
/// @param module the model.
/// @param parts which tensors to look at.
std::map<std::string, std::string> tied_names(const torch::nn::Module& module, StateParts parts);

/// Parameters of `model` that require grad, in registration order; a tensor registered under two names (a tied
/// weight) once, where it first appears, so that an optimizer steps it once and a wrapper reduces it once.
std::vector<at::Tensor> trainable_parameters(const torch::nn::Module& model);

}  // namespace shardlab
