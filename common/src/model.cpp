#include "shardlab/common/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <string>
#include <unordered_set>

namespace shardlab {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

Batch Batch::slice(int64_t start, int64_t length) const {
  return Batch{input.narrow(0, start, length), target.narrow(0, start, length), step};
}

Batch Batch::to(const c10::Device& device) const { return Batch{input.to(device), target.to(device), step}; }

void init_parameters(torch::nn::Module& module, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor p = item.value();
    const std::string& name = item.key();
    if (p.dim() >= 2) {
      p.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(p.size(1))), gen);
    } else if (ends_with(name, "bias")) {
      p.zero_();
    } else if (ends_with(name, "weight")) {  // LayerNorm gain
      p.fill_(1.0);
    } else {
      p.normal_(0.0, 0.1, gen);
    }
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (at::isFloatingType(item.value().scalar_type())) item.value().uniform_(0.5, 1.5, gen);
  }
}

std::vector<std::pair<std::string, at::Tensor>> named_state(const torch::nn::Module& module, StateParts parts,
                                                            bool once) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    if (t.defined() && (!once || seen.insert(t.unsafeGetTensorImpl()).second)) out.emplace_back(name, t);
  };
  if (parts != StateParts::kBuffers)
    for (const auto& item : module.named_parameters(/*recurse=*/true)) add(item.key(), item.value());
  if (parts != StateParts::kParameters)
    for (const auto& item : module.named_buffers(/*recurse=*/true)) add(item.key(), item.value());
  return out;
}

std::vector<at::Tensor> trainable_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (auto& [name, p] : named_state(model, StateParts::kParameters, /*once=*/true))
    if (p.requires_grad()) out.push_back(p);
  return out;
}

}  // namespace shardlab
