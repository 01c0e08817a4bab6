#pragma once
/// @file model.h
/// The models every stage trains. All are deterministic from a seed: the same seed gives bit-identical
/// parameters on every rank and every run, without touching the global RNG (ranks may be threads).
///
/// Vocabulary: a *Batch* is a pair (input, target) whose dim 0 is the batch dimension; `step` is the training step
/// it belongs to (some test models use it to leave a parameter without gradient on odd steps).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
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

/// A trainable model: a torch::nn::Module whose loss is the mean over the batch's examples (so averaging the
/// gradients of equal slices gives the gradient of the whole batch).
class Model : public torch::nn::Module {
 public:
  /// Mean loss over `batch` (scalar, requires grad).
  virtual at::Tensor loss(const Batch& batch) = 0;
};

/// Names accepted by make_model: "mlp", "tiny_gpt", "edge".
const std::vector<std::string>& model_names();

/// Builds model `name` with parameters drawn from `seed`.
/// @throws std::invalid_argument naming the accepted models if `name` is unknown.
std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed);

/// Model `name` from `seed`, initialized on CPU (so every device starts from bit-identical values) and then moved
/// to `device`. @throws std::invalid_argument as make_model(name, seed).
std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed, const c10::Device& device);

/// Fills every parameter and buffer of `module` from a private generator seeded with `seed` (normal, std 0.02 for
/// matrices, zeros for biases, ones for norm weights). Used by the models; exposed for tests that need ranks to
/// start from different weights.
void init_parameters(torch::nn::Module& module, uint64_t seed);

}  // namespace shardlab
