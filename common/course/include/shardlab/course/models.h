#pragma once
/// @file models.h
/// The concrete models behind make_model (model_factory.h). Include this only where the concrete type matters
/// (tests of the edge cases); everything else uses model_factory.h.

#include "shardlab/course/model_factory.h"

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace shardlab {

/// A multi-layer perceptron classifier: Linear → ReLU → … → Linear, cross-entropy loss. Each Linear is a unit.
class Mlp : public Model {
 public:
  /// @param sizes layer widths, input first, number of classes last (at least two entries).
  /// @param seed draws the initial weights.
  Mlp(const std::vector<int64_t>& sizes, uint64_t seed);
  /// Logits [B, classes].
  at::Tensor forward(const at::Tensor& x);
  /// Mean cross-entropy.
  at::Tensor loss(const Batch& batch) override;

 private:
  std::vector<UnitRef<torch::nn::LinearImpl>> layers_;
};

/// Shape of a TinyGpt.
struct GptConfig {
  int64_t vocab = 65;                  ///< number of distinct tokens (characters)
  int64_t block = 32;                  ///< context length T
  int64_t dim = kDefaultGptDim;        ///< embedding width
  int64_t heads = 2;                   ///< attention heads (dim % heads == 0)
  int64_t layers = kDefaultGptLayers;  ///< transformer blocks (each one unit)
};

/// One pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).
class GptBlock : public torch::nn::Module {
 public:
  /// Builds the block's layers (uninitialized: the owning model initializes them).
  explicit GptBlock(const GptConfig& c);
  /// [B, T, dim] → [B, T, dim], causal.
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc_{nullptr}, out_{nullptr};
};

/// A character-level GPT: token + position embeddings, causal attention blocks, a final LayerNorm, and an output
/// layer tied to the token embedding (one parameter used twice, registered under two names as Hugging Face's GPT-2
/// does: `wte.weight` and `lm_head.weight`). Each block is a unit; the embeddings, the final LayerNorm and so the
/// tied output layer are the root.
class TinyGpt : public Model {
 public:
  /// Builds the model and draws its parameters from `seed`.
  TinyGpt(const GptConfig& c, uint64_t seed);
  /// Logits [B, T, vocab] for tokens [B, T].
  at::Tensor forward(const at::Tensor& tokens);
  /// Mean next-token cross-entropy over B*T positions.
  at::Tensor loss(const Batch& batch) override;
  /// The shape it was built with.
  const GptConfig& config() const { return config_; }

 private:
  GptConfig config_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  std::vector<UnitRef<GptBlock>> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
  std::shared_ptr<torch::nn::Module> lm_head_;  // holds no tensor of its own: its `weight` is wte's
};

/// A small classifier with every edge case a data-parallel wrapper must handle:
///  - `frozen`   : a parameter with requires_grad = false (never communicated, never changes);
///  - `sometimes`: a parameter used only on even steps (no gradient on odd steps);
///  - `trunk`    : Linear(8, 7), whose dim 0 (7) does not divide by 2, 3 or 4;
///  - `scale`    : a buffer (drawn from the seed, so ranks built with different seeds differ until broadcast).
/// Units: `trunk` and `head` (dim 0 of 3 leaves a rank without rows at 4 ranks); the other three are the root.
class EdgeModel : public Model {
 public:
  /// Builds the model and draws its parameters and buffer from `seed`.
  explicit EdgeModel(uint64_t seed);
  /// Logits [B, 3]; uses `sometimes` only when `step` is even.
  at::Tensor forward(const at::Tensor& x, int64_t step);
  /// Mean cross-entropy.
  at::Tensor loss(const Batch& batch) override;

 private:
  UnitRef<torch::nn::LinearImpl> trunk_, head_;
  at::Tensor frozen_, sometimes_, scale_;
};

}  // namespace shardlab
