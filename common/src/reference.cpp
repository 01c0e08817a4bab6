#include "shardlab/common/reference.h"

#include "shardlab/common/compat.h"

#include "shardlab/common/data.h"
#include "shardlab/common/device.h"
#include "shardlab/common/grad_clip.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <stdexcept>

namespace shardlab {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, std::vector<at::Tensor> params,
                                                        double lr) {
  if (name == "sgd")
    return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(lr).momentum(0.9));
  if (name == "adamw")
    return std::make_unique<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(lr).weight_decay(0.01));
  throw std::invalid_argument("unknown optimizer '" + name + "'; expected sgd or adamw");
}

c10::Device device_of(const TrainConfig& config) {
  return device_for_rank(parse_device(config.device), /*local_rank=*/0);
}

std::shared_ptr<Model> make_model(const TrainConfig& config, const c10::Device& device) {
  if (config.model == "tiny_gpt") return make_tiny_gpt(config.layers, config.seed, device, config.dim);
  return make_model(config.model, config.seed, device);
}

ReferenceResult train_reference(const TrainConfig& config) {
  const c10::Device device = device_of(config);
  auto model = make_model(config, device);
  auto data = make_dataset(config.model, config.seed);
  auto optimizer = make_optimizer(config.optimizer, trainable_parameters(*model), config.lr);
  ReferenceResult result;
  for (int step = 0; step < config.steps; ++step) {
    compat::zero_grad(*optimizer);
    at::Tensor loss = model->loss(data->global_batch(step, config.global_batch).to(device));
    loss.backward();
    if (config.clip_norm > 0) clip_grad_norm(model->parameters(), config.clip_norm, config.clip_p, nullptr);
    optimizer->step();
    result.losses.push_back(loss.item<double>());
  }
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    result.names.push_back(item.key());
    result.params.push_back(item.value().detach().cpu().clone());
  }
  return result;
}

double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size())
    throw std::invalid_argument("max_abs_diff: " + std::to_string(a.size()) + " tensors vs " +
                                std::to_string(b.size()));
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].sizes().equals(b[i].sizes()))
      throw std::invalid_argument("max_abs_diff: tensor " + std::to_string(i) + " has shape " + c10::str(a[i].sizes()) +
                                  " vs " + c10::str(b[i].sizes()));
    if (a[i].numel() == 0) continue;
    const at::Tensor d = a[i].detach().to(at::kDouble).cpu() - b[i].detach().to(at::kDouble).cpu();
    worst = std::max(worst, d.abs().max().item<double>());
  }
  return worst;
}

bool all_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double rtol, double atol) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].sizes().equals(b[i].sizes()) || !at::allclose(a[i].detach().cpu(), b[i].detach().cpu(), rtol, atol))
      return false;
  return true;
}

}  // namespace shardlab
