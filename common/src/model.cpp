#include "shardlab/common/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <string>

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

}  // namespace shardlab
