#include "strategies.h"

#include "shardlab/common/data.h"
#include "shardlab/naive_ddp/naive_ddp.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace shardlab::cli {
namespace {

// Runs micro-batches and the optimizer; `Wrapper` decides how gradients are synchronized. Wrapper::no_sync() must
// return an RAII scope (stage 01 and later) — the single-device wrapper returns a dummy.
template <typename Wrapper>
class WrappedRunner : public StepRunner {
 public:
  WrappedRunner(const TrainConfig& c, std::shared_ptr<Model> model, std::unique_ptr<Wrapper> wrapper)
      : config_(c), model_(std::move(model)), wrapper_(std::move(wrapper)),
        optimizer_(make_optimizer(c.optimizer, trainable_parameters(*model_), c.lr)) {}

  double step(const Batch& local) override {
    optimizer_->zero_grad();
    const int m = config_.micro_batches;
    double loss_sum = 0;
    auto micro = micro_batches(local, m);
    for (int i = 0; i < m; ++i) {
      auto run = [&] {
        at::Tensor loss = wrapper_->loss(micro[i]) / m;
        loss.backward();
        loss_sum += loss.item<double>();
      };
      if (i + 1 < m) {
        [[maybe_unused]] auto scope = wrapper_->no_sync();
        run();
      } else {
        run();
      }
    }
    optimizer_->step();
    return loss_sum;
  }

  std::vector<at::Tensor> full_parameters() override { return model_->parameters(); }

 private:
  TrainConfig config_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<Wrapper> wrapper_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// The single-device "wrapper": no communication at all.
class SingleDevice {
 public:
  explicit SingleDevice(std::shared_ptr<Model> m) : model_(std::move(m)) {}
  at::Tensor loss(const Batch& b) { return model_->loss(b); }
  struct Scope {};
  Scope no_sync() { return {}; }

 private:
  std::shared_ptr<Model> model_;
};

// Naive DDP's traffic: one all-reduce per trainable parameter, of its full size (an upper bound when a
// parameter can go without a gradient in a step, as the edge model's `sometimes` does on odd steps).
Theory per_parameter_all_reduce(const Model& model) {
  Theory t;
  for (const auto& p : trainable_parameters(model)) {
    t.collectives += 1;
    t.bytes += static_cast<double>(p.numel() * p.element_size());
  }
  return t;
}

}  // namespace

const std::vector<Strategy>& strategies() {
  static const std::vector<Strategy> all{
      {"single", "one device, whole global batch (the reference)", false,
       [](const Model&, int) { return Theory{}; },
       [](const TrainConfig& c, Communicator*) -> std::unique_ptr<StepRunner> {
         auto model = make_model(c.model, c.seed);
         return std::make_unique<WrappedRunner<SingleDevice>>(c, model, std::make_unique<SingleDevice>(model));
       }},
      {"naive_ddp", "stage 01: one all-reduce per parameter gradient", true,
       [](const Model& m, int) { return per_parameter_all_reduce(m); },
       [](const TrainConfig& c, Communicator* comm) -> std::unique_ptr<StepRunner> {
         auto model = make_model(c.model, c.seed);
         return std::make_unique<WrappedRunner<naive_ddp::NaiveDDP>>(
             c, model, std::make_unique<naive_ddp::NaiveDDP>(model, *comm));
       }},
  };
  return all;
}

std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (const auto& s : strategies()) names.push_back(s.name);
  return names;
}

const Strategy& find_strategy(const std::string& name) {
  for (const auto& s : strategies())
    if (s.name == name) return s;
  std::string list;
  for (const auto& s : strategies()) list += (list.empty() ? "" : "|") + s.name;
  throw std::invalid_argument("unknown strategy '" + name + "'; expected one of " + list);
}

}  // namespace shardlab::cli
