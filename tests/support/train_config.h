#pragma once
// TrainConfig in one expression: `TrainConfig c = test_support::config("mlp").steps(3).global_batch(8);` sets the
// named fields and leaves the others at TrainConfig's defaults, as `TrainConfig c; c.model = "mlp"; ...` did.
#include "shardlab/course/reference.h"

#include "support/device.h"

#include <string>
#include <utility>

namespace shardlab::test_support {

/// A TrainConfig under construction: each setter sets the field of its name and returns the builder; it converts to
/// the TrainConfig it holds.
class ConfigBuilder {
 public:
  explicit ConfigBuilder(std::string model) { c_.model = std::move(model); }

  ConfigBuilder& optimizer(std::string v) { return c_.optimizer = std::move(v), *this; }
  ConfigBuilder& lr(double v) { return c_.lr = v, *this; }
  ConfigBuilder& steps(int v) { return c_.steps = v, *this; }
  ConfigBuilder& global_batch(int64_t v) { return c_.global_batch = v, *this; }
  ConfigBuilder& seed(uint64_t v) { return c_.seed = v, *this; }
  ConfigBuilder& micro_batches(int v) { return c_.micro_batches = v, *this; }
  ConfigBuilder& device(std::string v) { return c_.device = std::move(v), *this; }
  ConfigBuilder& layers(int64_t v) { return c_.layers = v, *this; }
  ConfigBuilder& dim(int64_t v) { return c_.dim = v, *this; }
  ConfigBuilder& clip_norm(double v) { return c_.clip_norm = v, *this; }

  /// Optimizer `name` at the learning rate the equivalence tests train it with: 1e-2 for AdamW, 0.05 for SGD.
  ConfigBuilder& optimizer_at_its_lr(const std::string& name) {
    return optimizer(name).lr(name == "adamw" ? 1e-2 : 0.05);
  }

  /// The batches (and the reference) on the device the suite runs on (device_name(): $SHARDLAB_TEST_DEVICE or CPU).
  ConfigBuilder& on_test_device() { return device(device_name()); }

  operator TrainConfig() const { return c_; }  // NOLINT(google-explicit-constructor): the point of a builder

 private:
  TrainConfig c_;
};

/// A builder of model `model`'s TrainConfig, every other field at its default.
inline ConfigBuilder config(std::string model) { return ConfigBuilder(std::move(model)); }

/// The config of an equivalence case: `model` trained by `optimizer` at its lr (optimizer_at_its_lr) on
/// `micro` micro-batches a step, on the test device; the steps, batch and seed are the suite's to set.
inline ConfigBuilder equivalence_config(std::string model, const std::string& optimizer, int micro) {
  return config(std::move(model)).optimizer_at_its_lr(optimizer).micro_batches(micro).on_test_device();
}

}  // namespace shardlab::test_support
