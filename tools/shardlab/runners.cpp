// The runners of the strategies' steps (runners.h).
#include "runners.h"

#include "traffic.h"

#include "shardlab/bucketed_ddp/auto_caps.h"
#include "shardlab/core/checkpoint/training_state.h"
#include "shardlab/core/comm/process_group.h"
#include "shardlab/core/compat.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/model/grad_clip.h"
#include "shardlab/core/parallel/standard_facets.h"
#include "shardlab/course/data.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::cli {
namespace {

// The single-device "wrapper": no communication at all.
class SingleDevice : public ReplicatedModel {
 public:
  explicit SingleDevice(std::shared_ptr<Model> m) : model_(std::move(m)) {}
  at::Tensor loss(const Batch& b) override { return model_->loss(b); }
  NoSync no_sync() override { return NoSync(sync_enabled_); }  // nothing to keep from syncing
  double clip_grad_norm(double max_norm, double p) override {
    return shardlab::clip_grad_norm(model_->parameters(), max_norm, p, nullptr);
  }
  // Checkpoints go through a group of one rank (no peer: its collectives return at once).
  void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                       const std::map<std::string, std::string>& metadata) override {
    save_training_checkpoint(dir, replicated_state(*model_, 0), optimizer, alone(), metadata);
  }
  std::map<std::string, std::string> load_checkpoint(const std::string& path, torch::optim::Optimizer* optimizer,
                                                     bool optimizer_if_saved, const SavedNames& names) override {
    return load_training_checkpoint(path, replicated_state(*model_, 0), optimizer, alone(), optimizer_if_saved, names);
  }

 protected:
  const Model& replica() const override { return *model_; }

 private:
  Communicator& alone() {
    if (!alone_) alone_ = make_communicator(c10::make_intrusive<c10d::HashStore>(), 0, 1, "single");
    return *alone_;
  }
  std::shared_ptr<Model> model_;
  std::shared_ptr<Communicator> alone_;
  bool sync_enabled_ = true;
};

// Bytes of every parameter, and of every trainable parameter's gradient: what a replica holds.
MemoryFigures replica_memory(const Model& model) {
  MemoryFigures m;
  for (const auto& [name, p] : named_state(model, StateParts::kParameters, /*once=*/true)) {
    m.peak_param_bytes += static_cast<double>(p.numel() * p.element_size());
    if (p.requires_grad()) m.peak_grad_bytes += static_cast<double>(p.numel() * p.element_size());
  }
  m.peak_param_bytes_theory = m.peak_param_bytes;
  m.peak_grad_bytes_theory = m.peak_grad_bytes;
  return m;
}

// Runs micro-batches and the optimizer on any ParallelModel, which decides how gradients are synchronized. With an
// `overlapped` optimizer (stage 03's hook_then_optimizer, already in the wrapper's reducer) the synchronized
// backward steps the parameters itself, and there is no optimizer step after it. What only some wrappers have it
// asks for as facets (Note [Facets, not downcasts]): buckets, measured memory, a step after the optimizer.
class WrappedRunner : public StepRunner {
 public:
  WrappedRunner(const TrainConfig& c, std::shared_ptr<Model> model, std::unique_ptr<ParallelModel> wrapper,
                std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped = nullptr,
                MicroBatchHook accumulation = nullptr)
      : accumulation_(std::move(accumulation)),
        config_(c),
        model_(std::move(model)),
        wrapper_(std::move(wrapper)),
        memory_facet_(wrapper_->facet<MemoryFacet>()),
        overlapped_(std::move(overlapped)),
        optimizer_(overlapped_ ? nullptr : make_optimizer(c.optimizer, wrapper_->parameters(), c.lr)) {
    // check_run_options refuses --clip-norm for a strategy that steps inside backward (Capabilities::clips)
    SHARDLAB_INTERNAL_ASSERT(c.clip_norm <= 0 || optimizer_ != nullptr, "--clip-norm with an overlapped optimizer");
  }

  double step(const Batch& local) override {
    const int step = static_cast<int>(local.step);
    if (overlapped_)
      overlapped_->zero_grad();
    else
      compat::zero_grad(*optimizer_);
    if (memory_facet_) memory_facet_->reset_memory_peaks();  // a wrapper that measures its own buffers, per step
    const int m = config_.micro_batches;
    double loss_sum = 0;
    auto micro = micro_batches(local, m);
    for (int i = 0; i < m; ++i) {
      auto run = [&] {
        at::Tensor loss;
        {
          Timeline::Scope span(timeline_, "forward", step);
          loss = wrapper_->loss(micro[i]) / m;
        }
        Timeline::Scope span(timeline_, "backward", step);
        loss.backward();
        loss_sum += loss.item<double>();
      };
      if (accumulation_) {
        accumulation_(i + 1 == m);
        run();
      } else if (i + 1 < m) {
        [[maybe_unused]] auto scope = wrapper_->no_sync();
        run();
      } else {
        run();
      }
    }
    if (optimizer_) {
      if (config_.clip_norm > 0) {
        Timeline::Scope span(timeline_, "clip", step);
        wrapper_->clip_grad_norm(config_.clip_norm, config_.clip_p);
      }
      Timeline::Scope span(timeline_, "optimizer", step);
      optimizer_->step();
    }
    // After the step: after optimizer_'s, or after the synchronized backward that stepped the overlapped optimizer.
    if (auto* seam = wrapper_->facet<StepSeam>()) seam->after_optimizer_step();
    const MemoryFigures now = step_memory();
    memory_.peak_param_bytes = std::max(memory_.peak_param_bytes, now.peak_param_bytes);
    memory_.peak_grad_bytes = std::max(memory_.peak_grad_bytes, now.peak_grad_bytes);
    memory_.peak_param_bytes_theory = now.peak_param_bytes_theory;
    memory_.peak_grad_bytes_theory = now.peak_grad_bytes_theory;
    return loss_sum;
  }

  void visit_full_parameters(const ParameterVisitor& visit) override {
    wrapper_->visit_full_parameters([&visit](size_t, const at::Tensor& p) { visit(p); });
  }
  // A sharded wrapper's registered parameters keep their full sizes (stage 04: only their storage is freed).
  std::vector<std::pair<std::string, std::vector<int64_t>>> full_parameter_shapes() const override {
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    for (const auto& item : model_->named_parameters()) out.emplace_back(item.key(), item.value().sizes().vec());
    return out;
  }
  size_t buckets() const override {
    const auto* ddp = wrapper_->facet<bucketed_ddp::BucketedDDP>();
    return ddp != nullptr ? ddp->buckets().size() : 0;
  }
  // --bucket-cap-kb auto: what the wrapper's AutoCaps chose (parallelize's BucketPolicy::auto_caps), with how many
  // buckets the chosen caps make by the cap rule over the order the layout took (rank 0's, as agree_on_order gives
  // every rank; the worker reports rank 0's figures), counted apart from stage 02.
  AutoCapsFigures auto_caps() const override {
    const auto* tuner = wrapper_->facet<bucketed_ddp::AutoCaps>();
    if (tuner == nullptr || !tuner->choice()) return {};
    const bucketed_ddp::CapChoice& c = *tuner->choice();
    AutoCapsFigures f;
    f.caps = {static_cast<double>(c.chosen.first_bytes),
              static_cast<double>(c.chosen.bytes),
              c.cost.alpha_ns,
              c.cost.beta_ns_per_byte,
              c.exposed_before_ns,
              c.exposed_chosen_ns};
    f.buckets_theory = static_cast<double>(buckets_by_cap_rule(c.profile.params, c.profile.order, c.chosen));
    return f;
  }
  // The auto caps' measurement: setup, not training traffic.
  std::pair<size_t, size_t> setup_records() const override {
    const auto* tuner = wrapper_->facet<bucketed_ddp::AutoCaps>();
    return tuner != nullptr && tuner->choice() ? tuner->choice()->setup : std::pair<size_t, size_t>{0, 0};
  }
  MemoryFigures memory() const override { return memory_; }
  void set_timeline(Timeline* timeline) override {
    timeline_ = timeline;
    if (memory_facet_) memory_facet_->record_memory_samples(timeline != nullptr);
  }
  // Trace counters: the bytes a wrapper that measures its memory held over time; nothing for the others.
  std::vector<CounterSample> counters() const override {
    std::vector<CounterSample> out;
    if (!memory_facet_) return out;
    for (const auto& s : memory_facet_->memory_samples())
      out.push_back(
          {"fsdp memory",
           s.ns,
           {{"param_bytes", static_cast<double>(s.param_bytes)}, {"grad_bytes", static_cast<double>(s.grad_bytes)}}});
    return out;
  }
  void save(const std::string& dir, const std::map<std::string, std::string>& metadata) override {
    SHARDLAB_INTERNAL_ASSERT(optimizer_ != nullptr, "--save with an overlapped optimizer");  // checkpoints()
    wrapper_->save_checkpoint(dir, optimizer_.get(), metadata);
  }
  std::map<std::string, std::string> load(const std::string& path) override {
    SHARDLAB_INTERNAL_ASSERT(optimizer_ != nullptr, "--resume with an overlapped optimizer");
    return wrapper_->load_checkpoint(path, optimizer_.get(), /*optimizer_if_saved=*/true, {});  // weights: fresh
  }

 private:
  // Per step: a wrapper's measured peaks beside its theory; a replica holds the full model.
  MemoryFigures step_memory() const {
    if (!memory_facet_) return replica_memory(*model_);
    const shardlab::MemoryFigures m =
        memory_facet_->memory_figures(config_.micro_batches, /*reduce_each_micro_batch=*/accumulation_ != nullptr);
    return {static_cast<double>(m.peak_param_bytes), static_cast<double>(m.peak_param_bytes_theory),
            static_cast<double>(m.peak_grad_bytes), static_cast<double>(m.peak_grad_bytes_theory)};
  }

  MicroBatchHook accumulation_;
  TrainConfig config_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<ParallelModel> wrapper_;
  MemoryFacet* memory_facet_;                                    // the wrapper's, or null
  std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped_;  // null: optimizer_ steps after backward
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  MemoryFigures memory_;
};

}  // namespace

std::unique_ptr<ParallelModel> single_device(std::shared_ptr<Model> model) {
  return std::make_unique<SingleDevice>(std::move(model));
}

std::unique_ptr<StepRunner> wrapped_runner(const TrainConfig& c, std::shared_ptr<Model> model,
                                           std::unique_ptr<ParallelModel> wrapper,
                                           std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped,
                                           MicroBatchHook accumulation) {
  return std::make_unique<WrappedRunner>(c, std::move(model), std::move(wrapper), std::move(overlapped),
                                         std::move(accumulation));
}

}  // namespace shardlab::cli
