#include "shardlab/course/models.h"

#include "shardlab/course/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <stdexcept>

namespace shardlab {
namespace {

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target) {
  return at::nll_loss(at::log_softmax(logits, -1), target);
}

}  // namespace

// ---- Mlp -------------------------------------------------------------------------------------------------------

Mlp::Mlp(const std::vector<int64_t>& sizes, uint64_t seed) {
  if (sizes.size() < 2) throw std::invalid_argument("Mlp: expected at least 2 layer sizes (input, classes)");
  Initializer init(seed);  // each unit initialized before it is registered: Note [Building a model unit by unit]
  for (size_t i = 0; i + 1 < sizes.size(); ++i)
    layers_.push_back(
        register_unit("fc" + std::to_string(i), init(std::make_shared<torch::nn::LinearImpl>(sizes[i], sizes[i + 1]))));
}

at::Tensor Mlp::forward(const at::Tensor& x) {
  at::Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    h = layers_[i](h);
    if (i + 1 < layers_.size()) h = at::relu(h);
  }
  return h;
}

at::Tensor Mlp::loss(const Batch& batch) { return cross_entropy(forward(batch.input), batch.target); }

// ---- TinyGpt ---------------------------------------------------------------------------------------------------

GptBlock::GptBlock(const GptConfig& c) : heads_(c.heads) {
  if (c.dim % c.heads != 0)
    throw std::invalid_argument("GptConfig: dim (" + std::to_string(c.dim) + ") must divide by heads (" +
                                std::to_string(c.heads) + ")");
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  // No bias on q/k/v: a key bias shifts every score of a query equally, so softmax ignores it and its true
  // gradient is exactly zero; Adam would turn the rounding noise of that zero into full-size steps.
  qkv_ = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(c.dim, 3 * c.dim).bias(false)));
  proj_ = register_module("proj", torch::nn::Linear(c.dim, c.dim));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  fc_ = register_module("fc", torch::nn::Linear(c.dim, 4 * c.dim));
  out_ = register_module("out", torch::nn::Linear(4 * c.dim, c.dim));
}

at::Tensor GptBlock::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads_;
  auto qkv = qkv_->forward(ln1_->forward(x)).chunk(3, -1);
  auto split = [&](const at::Tensor& t) { return t.reshape({B, T, heads_, hd}).transpose(1, 2); };
  at::Tensor q = split(qkv[0]), k = split(qkv[1]), v = split(qkv[2]);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  at::Tensor future = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(future, -INFINITY), -1);
  at::Tensor y = at::matmul(att, v).transpose(1, 2).reshape({B, T, D});
  at::Tensor h = x + proj_->forward(y);
  return h + out_->forward(at::gelu(fc_->forward(ln2_->forward(h))));
}

TinyGpt::TinyGpt(const GptConfig& c, uint64_t seed) : config_(c) {
  // Each part initialized as it is built, in registration order (Note [Building a model unit by unit]): under
  // sharded construction a block is sharded as soon as it is registered, and the next one is built after.
  Initializer init(seed);
  wte_ = register_module("wte", torch::nn::Embedding(c.vocab, c.dim));
  init.fill(*wte_);
  wpe_ = register_module("wpe", torch::nn::Embedding(c.block, c.dim));
  init.fill(*wpe_);
  for (int64_t i = 0; i < c.layers; ++i)
    blocks_.push_back(register_unit("block" + std::to_string(i), init(std::make_shared<GptBlock>(c))));
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
  init.fill(*ln_f_);
  // The output layer's name for the token embedding, as Hugging Face's GPT-2 registers it (its checkpoints hold
  // the tie under either name, or both): a second registration of the same tensor, not a second tensor.
  lm_head_ = register_module("lm_head", std::make_shared<torch::nn::Module>("lm_head"));
  lm_head_->register_parameter("weight", wte_->weight);
}

at::Tensor TinyGpt::forward(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  if (T > config_.block)
    throw std::invalid_argument("TinyGpt: sequence length " + std::to_string(T) + " exceeds block " +
                                std::to_string(config_.block));
  at::Tensor pos = at::arange(T, tokens.options().dtype(at::kLong));
  at::Tensor x = wte_->forward(tokens) + wpe_->forward(pos);
  for (auto& b : blocks_) x = b(x);
  // The output layer is the token embedding itself (weight tying): one parameter, two uses (and two names).
  return at::matmul(ln_f_->forward(x), wte_->weight.t());
}

at::Tensor TinyGpt::loss(const Batch& batch) {
  at::Tensor logits = forward(batch.input);
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), batch.target.reshape({-1}));
}

// ---- EdgeModel -------------------------------------------------------------------------------------------------

EdgeModel::EdgeModel(uint64_t seed) {
  // Drawn in the order the finished model lists its tensors (Note [Building a model unit by unit]): its own
  // parameters (libtorch lists them before its children's), the units as they are registered, then the buffer.
  Initializer init(seed);
  frozen_ = register_parameter("frozen", at::zeros({3}), /*requires_grad=*/false);
  sometimes_ = register_parameter("sometimes", at::zeros({3, 7}));
  init.fill_root(*this);
  trunk_ = register_unit("trunk", init(std::make_shared<torch::nn::LinearImpl>(8, 7)));
  head_ = register_unit("head", init(std::make_shared<torch::nn::LinearImpl>(7, 3)));
  scale_ = register_buffer("scale", at::ones({7}));
  init.fill_root(*this);
}

at::Tensor EdgeModel::forward(const at::Tensor& x, int64_t step) {
  at::Tensor h = at::relu(trunk_(x)) * scale_;
  at::Tensor out = head_(h) + frozen_;
  if (step % 2 == 0) out = out + at::matmul(h, sometimes_.t());
  return out;
}

at::Tensor EdgeModel::loss(const Batch& batch) { return cross_entropy(forward(batch.input, batch.step), batch.target); }

// ---- factory ---------------------------------------------------------------------------------------------------

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names{"mlp", "tiny_gpt", "edge"};
  return names;
}

bool leaves_parameters_unused(const std::string& name) {
  if (name == "mlp" || name == "tiny_gpt") return false;
  if (name == "edge") return true;  // `sometimes` is used on even steps only
  throw std::invalid_argument("unknown model '" + name + "'; expected one of: mlp, tiny_gpt, edge");
}

std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed) {
  if (name == "mlp") return std::make_shared<Mlp>(std::vector<int64_t>{16, 64, 64, 4}, seed);
  if (name == "tiny_gpt") {
    GptConfig c;
    c.vocab = static_cast<int64_t>(corpus_vocab().size());
    return std::make_shared<TinyGpt>(c, seed);
  }
  if (name == "edge") return std::make_shared<EdgeModel>(seed);
  throw std::invalid_argument("unknown model '" + name + "'; expected one of: mlp, tiny_gpt, edge");
}

std::shared_ptr<Model> make_tiny_gpt(int64_t layers, uint64_t seed, const c10::Device& device, int64_t dim) {
  if (layers < 1) throw std::invalid_argument("tiny_gpt: expected at least 1 layer; got " + std::to_string(layers));
  if (dim < 2 || dim % 2 != 0)
    throw std::invalid_argument("tiny_gpt: expected an even width >= 2 (2 heads); got " + std::to_string(dim));
  GptConfig c;
  c.vocab = static_cast<int64_t>(corpus_vocab().size());
  c.layers = layers;
  c.dim = dim;
  auto model = std::make_shared<TinyGpt>(c, seed);
  model->to(device);
  return model;
}

std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed, const c10::Device& device) {
  auto model = make_model(name, seed);
  model->to(device);
  return model;
}

}  // namespace shardlab
