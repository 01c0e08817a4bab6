#pragma once
/// @file reference.h
/// The ground truth: a single-device trainer that runs the same model, data and optimizer on the whole global
/// batch. Every stage's tests compare N ranks against it.

#include "shardlab/course/model_factory.h"

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

namespace shardlab {

/// What to train and how; shared by the reference and every strategy.
struct TrainConfig {
  std::string model = "mlp";           ///< see model_names()
  std::string optimizer = "sgd";       ///< "sgd" (momentum 0.9) or "adamw"
  double lr = 0.05;                    ///< learning rate
  int steps = 5;                       ///< optimizer steps
  int64_t global_batch = 8;            ///< examples per step over all ranks
  uint64_t seed = 1;                   ///< model and data seed
  int micro_batches = 1;               ///< gradient-accumulation micro-batches per step (per rank)
  std::string device = "cpu";          ///< where the model and batches live: "cpu", "cuda", "cuda:N" (see device.h)
  int64_t layers = kDefaultGptLayers;  ///< transformer blocks of "tiny_gpt" (the other models ignore it)
  int64_t dim = kDefaultGptDim;        ///< width of "tiny_gpt" (the other models ignore it)
  double clip_norm = 0.0;              ///< > 0: before each step, clip the gradients' global norm to it (grad_clip.h)
  double clip_p = 2.0;                 ///< the norm clip_norm bounds: 2, or infinity
};

/// Model `config.model` from `config.seed` (tiny_gpt with `config.layers` blocks), initialized on CPU and moved
/// to `device`. @throws std::invalid_argument as make_model does.
std::shared_ptr<Model> make_model(const TrainConfig& config, const c10::Device& device);

/// The device `config.device` names, for one process ("cuda" means cuda:0), checked as device_for_rank does.
/// @throws std::invalid_argument naming what was expected and what came.
c10::Device device_of(const TrainConfig& config);

/// Builds optimizer `name` ("sgd" or "adamw") over `params`.
/// @throws std::invalid_argument naming the accepted optimizers.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, std::vector<at::Tensor> params,
                                                        double lr);

// trainable_parameters (the parameters an optimizer steps, a tied weight once) is in model.h.

/// Result of a reference run.
struct ReferenceResult {
  std::vector<double> losses;      ///< loss of each step (over the global batch)
  std::vector<std::string> names;  ///< parameter names, registration order
  std::vector<at::Tensor> params;  ///< final parameter values (all, trainable or not)
  double final_loss = 0.0;         ///< the final parameters' loss on the batch of step `config.steps` (no step taken)
};

/// Trains `config.model` on one device (`config.device`; "cuda" means cuda:0) for `config.steps` steps on the whole
/// global batch of each step.
ReferenceResult train_reference(const TrainConfig& config);

/// The loss that `params` (every parameter of `config`'s model in registration order, as ReferenceResult::params
/// holds them) give on the global batch of step `step`, on one device, without a step: the loss a run's last update
/// leads to, comparable with ReferenceResult::final_loss (Note [Comparing with one device]).
/// @throws std::invalid_argument when `params` does not match the model's parameters in count or shape.
double loss_at(const TrainConfig& config, const std::vector<at::Tensor>& params, int step);

/// The most that any two AdamW runs of `config` (make_optimizer's AdamW) from the same parameters can differ by, in
/// any one element, after `steps` steps, whatever gradients each saw: 2 lr sum_t C_t, with C_t the largest update
/// Adam's bias-corrected moments allow at step t (Note [Comparing with one device]). Returns 0 for SGD, whose
/// parameters are compared tightly instead.
double adamw_divergence_bound(const TrainConfig& config, int steps);

/// Largest |a[i] - b[i]| over all elements of all tensors. @throws std::invalid_argument on count/shape mismatch.
double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b);

/// True when every element satisfies |a - b| <= atol + rtol * |b|, over all tensors.
bool all_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double rtol, double atol);

}  // namespace shardlab
