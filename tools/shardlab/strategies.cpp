#include "strategies.h"

#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/comm_hooks/optimizer_overlap.h"
#include "shardlab/core/checkpoint/training_state.h"
#include "shardlab/core/comm/process_group.h"
#include "shardlab/core/compat.h"
#include "shardlab/core/device/device.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/model/grad_clip.h"
#include "shardlab/course/data.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/hsdp/hsdp.h"
#include "shardlab/naive_ddp/naive_ddp.h"
#include "shardlab/prefetch/prefetch.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

namespace shardlab::cli {
namespace {

// Model `c.model` on `c.device` (an index the worker has already resolved for this rank).
std::shared_ptr<Model> model_on_device(const TrainConfig& c) { return make_model(c, parse_device(c.device)); }

// What the sharded strategies give FSDP to build `c.model` unit by unit (Note [Sharded construction]): the model on
// the CPU, kept in `built` for the runner; FSDP moves each unit to the device as it shards it.
ModelBuilder sharded_builder(const TrainConfig& c, std::shared_ptr<Model>& built) {
  return [&c, &built] { return built = make_model(c, at::kCPU); };
}

// Why the replicated strategies build the whole model (Strategy::construction).
const char* const kWholeReplica = "whole: every rank keeps a full replica (DDP), built, then rank 0's state broadcast";

// The single-device "wrapper": no communication at all.
class SingleDevice {
 public:
  explicit SingleDevice(std::shared_ptr<Model> m) : model_(std::move(m)) {}
  at::Tensor loss(const Batch& b) { return model_->loss(b); }
  double clip_grad_norm(double max_norm, double p) {
    return shardlab::clip_grad_norm(model_->parameters(), max_norm, p, nullptr);
  }
  struct Scope {};
  Scope no_sync() { return {}; }
  // Checkpoints go through a group of one rank (no peer: its collectives return at once).
  void save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                       const std::map<std::string, std::string>& metadata) {
    save_training_checkpoint(dir, replicated_state(*model_, 0), optimizer, alone(), metadata);
  }
  std::map<std::string, std::string> load_checkpoint(const std::string& path, torch::optim::Optimizer* optimizer,
                                                     bool optimizer_if_saved) {
    return load_training_checkpoint(path, replicated_state(*model_, 0), optimizer, alone(), optimizer_if_saved);
  }

 private:
  Communicator& alone() {
    if (!alone_) alone_ = make_communicator(c10::make_intrusive<c10d::HashStore>(), 0, 1, "single");
    return *alone_;
  }
  std::shared_ptr<Model> model_;
  std::shared_ptr<Communicator> alone_;
};

size_t bucket_count(const SingleDevice&) { return 0; }
size_t bucket_count(const naive_ddp::NaiveDDP&) { return 0; }
size_t bucket_count(const bucketed_ddp::BucketedDDP& ddp) { return ddp.buckets().size(); }
size_t bucket_count(const fsdp::FullyShardedModel&) { return 0; }

// What the optimizer steps: a replica's trainable parameters, or FSDP's shards.
template <typename Wrapper>
std::vector<at::Tensor> optimizer_parameters(Wrapper&, Model& model) {
  return trainable_parameters(model);
}
std::vector<at::Tensor> optimizer_parameters(fsdp::FullyShardedModel& w, Model&) { return w.parameters(); }

// Every parameter as one device holds it, in registration order: a replica's own, or FSDP's gathered from the
// shards one unit at a time (a collective).
template <typename Wrapper>
void visit_full_parameters_of(Wrapper&, Model& model, const ParameterVisitor& visit) {
  for (const auto& p : model.parameters()) visit(p);  // per registration, as the reference and FSDP list them
}
void visit_full_parameters_of(fsdp::FullyShardedModel& w, Model&, const ParameterVisitor& visit) {
  w.visit_full_parameters([&visit](size_t, const at::Tensor& p) { visit(p); });
}

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

// Trace counters: FSDP's bytes held over time; nothing for the others.
template <typename Wrapper>
void record_counters(Wrapper&, bool) {}
void record_counters(fsdp::FullyShardedModel& w, bool on) { w.record_memory_samples(on); }
template <typename Wrapper>
std::vector<CounterSample> counters_of(const Wrapper&) {
  return {};
}
std::vector<CounterSample> counters_of(const fsdp::FullyShardedModel& w) {
  std::vector<CounterSample> out;
  for (const auto& s : w.memory_samples())
    out.push_back(
        {"fsdp memory",
         s.ns,
         {{"param_bytes", static_cast<double>(s.param_bytes)}, {"grad_bytes", static_cast<double>(s.grad_bytes)}}});
  return out;
}

// Per step: FSDP measures its own buffers; the others hold a full replica.
template <typename Wrapper>
void begin_step_memory(Wrapper&) {}
void begin_step_memory(fsdp::FullyShardedModel& w) { w.reset_memory_peaks(); }
template <typename Wrapper>
MemoryFigures step_memory(const Wrapper&, const Model& model, int /*micro_batches*/, fsdp::Accumulation) {
  return replica_memory(model);
}
MemoryFigures step_memory(const fsdp::FullyShardedModel& w, const Model&, int micro_batches,
                          fsdp::Accumulation accumulation) {
  const fsdp::MemoryTheory t = w.memory_theory(micro_batches, accumulation);
  return {static_cast<double>(w.memory().peak_param_bytes), static_cast<double>(t.peak_param_bytes),
          static_cast<double>(w.memory().peak_grad_bytes), static_cast<double>(t.peak_grad_bytes)};
}

// How the micro-batches of a step before the last keep their gradients local: null = Wrapper::no_sync(); else
// called with false before each of them and with true before the last (HSDP's deferred all-reduce).
using MicroBatchHook = std::function<void(bool last)>;

// Runs micro-batches and the optimizer; `Wrapper` decides how gradients are synchronized. Wrapper::no_sync() must
// return an RAII scope (stage 01 and later) — the single-device wrapper returns a dummy. With an `overlapped`
// optimizer (stage 03's hook_then_optimizer, already in the wrapper's reducer) the synchronized backward steps the
// parameters itself, and there is no optimizer step after it. `keep` is whatever the wrapper needs alive until it
// is gone (HSDP's mesh).
template <typename Wrapper>
class WrappedRunner : public StepRunner {
 public:
  WrappedRunner(const TrainConfig& c, std::shared_ptr<Model> model, std::unique_ptr<Wrapper> wrapper,
                std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped = nullptr,
                std::shared_ptr<void> keep = nullptr, MicroBatchHook accumulation = nullptr)
      : keep_(std::move(keep)),
        accumulation_(std::move(accumulation)),
        config_(c),
        model_(std::move(model)),
        wrapper_(std::move(wrapper)),
        overlapped_(std::move(overlapped)),
        optimizer_(overlapped_ ? nullptr
                               : make_optimizer(c.optimizer, optimizer_parameters(*wrapper_, *model_), c.lr)) {
    // check_run_options refuses --clip-norm for a strategy that steps inside backward (clips())
    SHARDLAB_INTERNAL_ASSERT(c.clip_norm <= 0 || optimizer_ != nullptr, "--clip-norm with an overlapped optimizer");
  }

  double step(const Batch& local) override {
    const int step = static_cast<int>(local.step);
    if (overlapped_)
      overlapped_->zero_grad();
    else
      compat::zero_grad(*optimizer_);
    begin_step_memory(*wrapper_);
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
    const MemoryFigures now = step_memory(*wrapper_, *model_, config_.micro_batches,
                                          accumulation_ ? fsdp::Accumulation::kReduce : fsdp::Accumulation::kNoSync);
    memory_.peak_param_bytes = std::max(memory_.peak_param_bytes, now.peak_param_bytes);
    memory_.peak_grad_bytes = std::max(memory_.peak_grad_bytes, now.peak_grad_bytes);
    memory_.peak_param_bytes_theory = now.peak_param_bytes_theory;
    memory_.peak_grad_bytes_theory = now.peak_grad_bytes_theory;
    return loss_sum;
  }

  void visit_full_parameters(const ParameterVisitor& visit) override {
    visit_full_parameters_of(*wrapper_, *model_, visit);
  }
  size_t buckets() const override { return bucket_count(*wrapper_); }
  MemoryFigures memory() const override { return memory_; }
  void set_timeline(Timeline* timeline) override {
    timeline_ = timeline;
    record_counters(*wrapper_, timeline != nullptr);
  }
  std::vector<CounterSample> counters() const override { return counters_of(*wrapper_); }
  void save(const std::string& dir, const std::map<std::string, std::string>& metadata) override {
    SHARDLAB_INTERNAL_ASSERT(optimizer_ != nullptr, "--save with an overlapped optimizer");  // checkpoints()
    wrapper_->save_checkpoint(dir, optimizer_.get(), metadata);
  }
  std::map<std::string, std::string> load(const std::string& path) override {
    SHARDLAB_INTERNAL_ASSERT(optimizer_ != nullptr, "--resume with an overlapped optimizer");
    return wrapper_->load_checkpoint(path, optimizer_.get(), /*optimizer_if_saved=*/true);  // weights: a fresh one
  }

 protected:
  Wrapper& wrapper() { return *wrapper_; }

 private:
  std::shared_ptr<void> keep_;  // first: destroyed after the wrapper
  MicroBatchHook accumulation_;
  TrainConfig config_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<Wrapper> wrapper_;
  std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped_;  // null: optimizer_ steps after backward
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  MemoryFigures memory_;
};

// Bytes one reduction of every trainable gradient sends, `scale` times its own size (0.5 when compressed to 16
// bits): what the algorithm asks for. (Gloo 1.13 sends bf16 as f32; the report shows the measured bytes beside.)
double payload_bytes(const Model& model, double scale) {
  double bytes = 0;
  for (const auto& p : trainable_parameters(model)) bytes += static_cast<double>(p.numel() * p.element_size()) * scale;
  return bytes;
}

// Naive DDP's traffic: one all-reduce per trainable parameter, of its full size (an upper bound when a
// parameter can go without a gradient in a step, as the edge model's `sometimes` does on odd steps).
Theory per_parameter_all_reduce(const Model& model) {
  return {static_cast<double>(trainable_parameters(model).size()), payload_bytes(model, 1.0), {}};
}

bucketed_ddp::BucketCaps caps(const StrategyOptions& s) { return {s.first_bucket_cap_bytes, s.bucket_cap_bytes}; }

bucketed_ddp::Options ddp_options(const StrategyOptions& s, const std::string& model) {
  bucketed_ddp::Options o;
  o.caps = caps(s);
  o.find_unused_parameters = model == "edge";  // it leaves `sometimes` without gradient on odd steps
  return o;
}

// How many buckets the cap rule of bucket_plan.h makes of `params` taken in `order`. Counted here from the rule
// as documented, not with stage 02's assign_buckets: the theory must come from somewhere else than the code it
// checks, or a wrong cap rule would agree with itself. The rule: per dtype, gradients join the open bucket in turn;
// a bucket closes once it holds at least its cap (first_bytes for the first bucket of each dtype, bytes after), and
// whatever is still open at the end is one more bucket.
int64_t buckets_by_cap_rule(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                            const bucketed_ddp::BucketCaps& caps) {
  struct Open {
    int64_t bytes = 0;
    size_t params = 0;
    bool first = true;
  };
  std::map<c10::ScalarType, Open> open;
  int64_t closed = 0;
  for (size_t i : order) {
    const at::Tensor& p = params.at(i);
    Open& b = open[p.scalar_type()];
    b.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    ++b.params;
    if (b.bytes >= (b.first ? caps.first_bytes : caps.bytes)) {
      ++closed;
      b = Open{0, 0, false};
    }
  }
  for (const auto& [dtype, b] : open) closed += b.params > 0 ? 1 : 0;
  return closed;
}

// The same, in reverse registration order (the layout before the first rebuild).
int64_t buckets_by_cap_rule(const std::vector<at::Tensor>& params, const bucketed_ddp::BucketCaps& caps) {
  std::vector<size_t> reversed(params.size());
  for (size_t i = 0; i < params.size(); ++i) reversed[i] = params.size() - 1 - i;
  return buckets_by_cap_rule(params, reversed, caps);
}

// Bucketed DDP's traffic: one all-reduce per bucket (laid out in reverse registration order, as before the
// rebuild; the rebuild keeps the count for these models), of the whole gradient.
Theory per_bucket_all_reduce(const Model& model, const StrategyOptions& s, double scale) {
  const int64_t buckets = buckets_by_cap_rule(trainable_parameters(model), caps(s));
  return {static_cast<double>(buckets), payload_bytes(model, scale), {}};
}

// --bucket-cap-kb auto: after step 2 (the first warm backward, on the rebuilt layout) measure the all-reduce's
// alpha and beta on the group and let stage 02's cost model choose both caps from that backward's ready times.
// Ranks saw different ready times: rank 0's choice is broadcast, and every rank lays its buckets out again with it.
class AutoCapsRunner : public WrappedRunner<bucketed_ddp::BucketedDDP> {
 public:
  AutoCapsRunner(const TrainConfig& c, std::shared_ptr<Model> model, std::unique_ptr<bucketed_ddp::BucketedDDP> ddp,
                 Communicator& comm, std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped)
      : WrappedRunner(c, model, std::move(ddp), std::move(overlapped)),
        comm_(comm),
        device_(model->parameters().front().device()) {}

  double step(const Batch& local) override {
    const double loss = WrappedRunner::step(local);
    // After the run's step 2 (index 1), by the step's index: a run resumed later has its caps from the checkpoint.
    if (local.step == 1) tune();
    return loss;
  }
  std::map<std::string, std::vector<double>> extra() const override { return extra_; }
  std::pair<size_t, size_t> setup_records() const override { return setup_records_; }

 private:
  void tune() {
    bucketed_ddp::BucketedDDP& ddp = wrapper();
    const size_t first_record = comm_.recorder().size();
    const bucketed_ddp::LinkCost cost = bucketed_ddp::measure_all_reduce_cost(comm_, device_);
    const bucketed_ddp::BackwardProfile profile = ddp.last_backward_profile();
    const bucketed_ddp::BucketCaps before = ddp.caps();
    // Every rank chooses from its own profile; rank 0's choice is broadcast below.
    bucketed_ddp::BucketCaps chosen = bucketed_ddp::choose_caps(profile, cost, {}, before);
    at::Tensor wire = at::tensor({chosen.first_bytes, chosen.bytes}, at::kLong).to(device_);
    comm_.broadcast(wire, 0).wait();
    wire = wire.cpu();
    chosen = {wire[0].item<int64_t>(), wire[1].item<int64_t>()};
    ddp.set_caps(chosen);
    // What the new layout must hold: the cap rule over the order it is laid out in (rank 0's, as agree_on_order
    // gives every rank; the worker reports rank 0's figures), counted apart from stage 02.
    extra_["auto_caps_buckets_theory"] = {
        static_cast<double>(buckets_by_cap_rule(profile.params, profile.order, chosen))};
    // The measurement's collectives are setup, not training traffic.
    setup_records_ = {first_record, comm_.recorder().size()};
    extra_["auto_caps"] = {static_cast<double>(chosen.first_bytes),
                           static_cast<double>(chosen.bytes),
                           cost.alpha_ns,
                           cost.beta_ns_per_byte,
                           bucketed_ddp::modelled_exposed_ns(profile, before, cost),
                           bucketed_ddp::modelled_exposed_ns(profile, chosen, cost)};
  }

  Communicator& comm_;
  c10::Device device_;
  std::map<std::string, std::vector<double>> extra_;
  std::pair<size_t, size_t> setup_records_{0, 0};
};

// BucketedDDP's runner: plain, or with auto caps.
std::unique_ptr<StepRunner> bucketed_runner(const TrainConfig& c, const StrategyOptions& s, Communicator& comm,
                                            std::shared_ptr<Model> model, bucketed_ddp::Options options,
                                            std::shared_ptr<comm_hooks::OverlappedOptimizer> overlapped = nullptr) {
  auto ddp = std::make_unique<bucketed_ddp::BucketedDDP>(model, comm, std::move(options));
  if (s.auto_caps) return std::make_unique<AutoCapsRunner>(c, model, std::move(ddp), comm, std::move(overlapped));
  return std::make_unique<WrappedRunner<bucketed_ddp::BucketedDDP>>(c, model, std::move(ddp), std::move(overlapped));
}

// A strategy that runs BucketedDDP with one of stage 03's hooks ("" = stage 02's plain all-reduce of the average).
Strategy bucketed(std::string name, std::string description, std::string hook, double scale) {
  return {std::move(name),
          std::move(description),
          true,
          [scale](const Model& m, int, const StrategyOptions& s, const TrainConfig&) {
            return per_bucket_all_reduce(m, s, scale);
          },
          [hook](const TrainConfig& c, const StrategyOptions& s, World* world) -> std::unique_ptr<StepRunner> {
            auto model = model_on_device(c);
            bucketed_ddp::Options options = ddp_options(s, c.model);
            if (!hook.empty())
              options.reducer = comm_hooks::as_bucket_reducer(comm_hooks::make_hook(hook, world->world()));
            return bucketed_runner(c, s, world->world(), model, std::move(options));
          },
          kWholeReplica};
}

// Bucketed DDP whose buckets step their own parameters as their averages land (stage 03's hook_then_optimizer):
// the same traffic as bucketed_ddp, no optimizer step after backward.
Strategy overlapped_optimizer() {
  return {"overlap_optimizer",
          "stage 03: buckets step their parameters as their averages land",
          true,
          [](const Model& m, int, const StrategyOptions& s, const TrainConfig&) {
            return per_bucket_all_reduce(m, s, 1.0);
          },
          [](const TrainConfig& c, const StrategyOptions& s, World* world) -> std::unique_ptr<StepRunner> {
            auto model = model_on_device(c);
            auto optimizer = std::make_shared<comm_hooks::OverlappedOptimizer>(
                trainable_parameters(*model),
                [&c](std::vector<at::Tensor> p) { return make_optimizer(c.optimizer, std::move(p), c.lr); });
            bucketed_ddp::Options options = ddp_options(s, c.model);
            options.reducer = comm_hooks::hook_then_optimizer(nullptr, optimizer);
            return bucketed_runner(c, s, world->world(), model, std::move(options), optimizer);
          },
          kWholeReplica};
}

fsdp::Options fsdp_options(const StrategyOptions& s, const std::string& model) {
  fsdp::Options o;
  o.reshard_after_forward = s.reshard_after_forward;
  o.pool_buffers = s.pool_buffers;
  if (!s.param_dtype.empty()) o.mixed_precision.param_dtype = fsdp::parse_dtype(s.param_dtype);
  if (!s.reduce_dtype.empty()) o.mixed_precision.reduce_dtype = fsdp::parse_dtype(s.reduce_dtype);
  o.allow_unused_parameters = model == "edge";  // `sometimes` has no gradient on odd steps
  return o;
}

// One FSDP unit as theory sees it, on a group of `world` ranks: Σ padded shard numel of its parameters, of its
// trainable ones (a gradient row), and whether it is the root (the parameters of no unit).
struct UnitShards {
  double shard = 0;
  double grad_row = 0;
  bool root = false;
};

// The units of `model` sharded `world` ways: its blocks, then the root when it has parameters.
std::vector<UnitShards> unit_shards(const Model& model, int world) {
  std::vector<UnitShards> units;
  std::set<const c10::TensorImpl*> in_unit;
  auto add = [&](const std::vector<at::Tensor>& params, bool root) {
    UnitShards u;
    u.root = root;
    for (const auto& p : params) {
      const auto spec = fsdp::shard_spec(p.sizes(), world);
      u.shard += static_cast<double>(spec.padded_numel());
      if (p.requires_grad()) u.grad_row += static_cast<double>(spec.padded_numel());
    }
    units.push_back(u);
  };
  for (const auto& unit : model.units()) {
    const auto params = unit.module->parameters();
    for (const auto& p : params) in_unit.insert(p.unsafeGetTensorImpl());
    add(params, false);
  }
  std::vector<at::Tensor> root;  // a tied weight once
  for (const auto& [name, p] : named_state(model, StateParts::kParameters, /*once=*/true))
    if (!in_unit.count(p.unsafeGetTensorImpl())) root.push_back(p);
  if (!root.empty()) add(root, true);
  return units;
}

// Bytes per element of the gathered parameters and of the reduced gradients.
double param_elem(const StrategyOptions& s) {
  return s.param_dtype.empty() ? 4.0 : static_cast<double>(c10::elementSize(fsdp::parse_dtype(s.param_dtype)));
}
double reduce_elem(const StrategyOptions& s) {
  const std::string reduce = s.reduce_dtype.empty() ? s.param_dtype : s.reduce_dtype;
  return reduce.empty() ? 4.0 : static_cast<double>(c10::elementSize(fsdp::parse_dtype(reduce)));
}

// FSDP's traffic per step on a group of `world` ranks, from the layout: forward gathers every unit once, backward
// gathers the units again when they were freed (raf) and reduce-scatters every unit with trainable parameters
// `reduces` times; every micro-batch gathers. Bytes are what rank 0 hands to the backend: its padded shards for an
// all-gather; for a reduce-scatter, N-1 of the N rows of padded gradients on CPU where the ring pays (Note [Ring
// reduce-scatter]) or all N (NCCL's own, Gloo's all-reduce fallback).
Traffic sharded_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train,
                        int reduces) {
  const double elem = param_elem(s), relem = reduce_elem(s);
  Traffic t;
  for (const UnitShards& u : unit_shards(model, world)) {
    const int gathers = (1 + (!u.root && s.reshard_after_forward ? 1 : 0)) * train.micro_batches;
    const int rs = u.grad_row > 0 ? reduces : 0;
    t.collectives += gathers + rs;
    const bool ring = parse_device(train.device).is_cpu() &&
                      ring_reduce_scatter_pays(world, static_cast<int64_t>(world * u.grad_row * relem));
    const int rows_sent = ring ? world - 1 : world;
    t.bytes += gathers * u.shard * elem + rs * rows_sent * u.grad_row * relem;
  }
  if (train.clip_norm > 0 && world > 1) {  // the clip's all-reduce of one double joins the shards' norms
    t.collectives += 1;
    t.bytes += 8;
  }
  return t;
}

// Stage 04's FSDP: every micro-batch but the last under no_sync, so one reduce-scatter per unit per step.
Theory fsdp_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train) {
  const Traffic t = sharded_traffic(model, world, s, train, 1);
  return {t.collectives, t.bytes, {{"world", t}}};
}

// HSDP on an R x S mesh: FSDP's traffic on the shard group (S ranks; k reduce-scatters per step when the
// all-reduce is deferred over k micro-batches, else one), and on the replicate group one all-reduce per unit with
// trainable parameters per step, of its gradient row (Σ padded shard numel, padding included) in the reduce dtype.
// One replica (R = 1) has no replicate traffic at all.
Theory hsdp_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train) {
  const auto [replicas, shards] = mesh_shape(s, world);
  const Traffic shard = sharded_traffic(model, shards, s, train, s.defer_all_reduce ? train.micro_batches : 1);
  Traffic replicate;
  if (replicas > 1)
    for (const UnitShards& u : unit_shards(model, shards))
      if (u.grad_row > 0) {
        replicate.collectives += 1;
        replicate.bytes += u.grad_row * reduce_elem(s);
      }
  Theory t{shard.collectives + replicate.collectives, shard.bytes + replicate.bytes, {{"shard", shard}}};
  if (replicas > 1) t.groups["replicate"] = replicate;
  return t;
}

// Stage 05: FSDP with the next units' all-gathers issued ahead (--prefetch-depth, --prefetch-limit). The same
// collectives as fsdp, so the same traffic.
void prefetch_as_told(fsdp::FullyShardedModel& wrapper, const StrategyOptions& s) {
  prefetch::PrefetchPolicy policy;
  policy.forward_depth = s.prefetch_depth;
  policy.backward_depth = s.prefetch_depth;
  policy.max_in_flight = s.prefetch_limit;
  prefetch::enable_prefetch(wrapper, policy);
}

// Stage 04's FSDP, built sharded; with stage 05's prefetch when `prefetch`.
std::unique_ptr<StepRunner> fsdp_runner(const TrainConfig& c, const StrategyOptions& s, World* world, bool prefetch) {
  std::shared_ptr<Model> model;
  auto wrapper = std::make_unique<fsdp::FullyShardedModel>(sharded_builder(c, model), world->world(),
                                                           fsdp_options(s, c.model), parse_device(c.device));
  if (prefetch) prefetch_as_told(*wrapper, s);
  return std::make_unique<WrappedRunner<fsdp::FullyShardedModel>>(c, model, std::move(wrapper));
}

// Stage 06: HSDP on the mesh of mesh_shape(), with stage 05's prefetch inside each replica. Micro-batches before
// the last run under no_sync, or with the all-reduce deferred (--defer-all-reduce true).
std::unique_ptr<StepRunner> hsdp_runner(const TrainConfig& c, const StrategyOptions& s, World* world) {
  const auto [replicas, shards] = mesh_shape(s, world->size());
  auto mesh = std::make_shared<Mesh>(*world, replicas, shards);
  std::shared_ptr<Model> model;
  auto wrapper = hsdp::fully_shard_hybrid(sharded_builder(c, model), *mesh, fsdp_options(s, c.model),
                                          Wire::kReduceDtype, parse_device(c.device));
  prefetch_as_told(*wrapper, s);
  MicroBatchHook accumulation;
  if (s.defer_all_reduce) {
    fsdp::FullyShardedModel* w = wrapper.get();
    accumulation = [w](bool last) { hsdp::set_requires_all_reduce(*w, last); };
  }
  return std::make_unique<WrappedRunner<fsdp::FullyShardedModel>>(c, model, std::move(wrapper), nullptr,
                                                                  std::move(mesh), std::move(accumulation));
}

}  // namespace

const std::vector<Strategy>& strategies() {
  static const std::vector<Strategy> all{
      {"single", "one device, whole global batch (the reference)", false,
       [](const Model&, int, const StrategyOptions&, const TrainConfig&) { return Theory{}; },
       [](const TrainConfig& c, const StrategyOptions&, World*) -> std::unique_ptr<StepRunner> {
         auto model = model_on_device(c);
         return std::make_unique<WrappedRunner<SingleDevice>>(c, model, std::make_unique<SingleDevice>(model));
       },
       "whole: one device holds the model"},
      {"naive_ddp", "stage 01: one all-reduce per parameter gradient", true,
       [](const Model& m, int, const StrategyOptions&, const TrainConfig&) { return per_parameter_all_reduce(m); },
       [](const TrainConfig& c, const StrategyOptions&, World* world) -> std::unique_ptr<StepRunner> {
         auto model = model_on_device(c);
         return std::make_unique<WrappedRunner<naive_ddp::NaiveDDP>>(
             c, model, std::make_unique<naive_ddp::NaiveDDP>(model, world->world()));
       },
       kWholeReplica},
      bucketed("bucketed_ddp", "stage 02: flat buckets, async all-reduce overlapped with backward", "", 1.0),
      bucketed("hook_allreduce", "stage 03: buckets through the fp32 hook (pre/post divide)", "allreduce", 1.0),
      bucketed("hook_fp16", "stage 03: buckets compressed to fp16 on the wire", "fp16", 0.5),
      bucketed("hook_bf16", "stage 03: buckets compressed to bf16 (Gloo 1.13: sent as f32)", "bf16", 0.5),
      overlapped_optimizer(),
      {"fsdp", "stage 04: sharded units, all-gather before use, reduce-scatter of gradients", true, fsdp_traffic,
       [](const TrainConfig& c, const StrategyOptions& s, World* world) { return fsdp_runner(c, s, world, false); },
       "sharded"},
      {"fsdp_prefetch", "stage 05: FSDP with the next units' all-gathers in flight while this unit computes", true,
       fsdp_traffic,
       [](const TrainConfig& c, const StrategyOptions& s, World* world) { return fsdp_runner(c, s, world, true); },
       "sharded"},
      {"hsdp", "stage 06: sharded within each replica of an RxS mesh, all-reduced across replicas (--mesh)", true,
       hsdp_traffic, hsdp_runner, "sharded"},
  };
  return all;
}

std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (const auto& s : strategies()) names.push_back(s.name);
  return names;
}

std::string group_role(const std::string& group_name) { return group_name.substr(0, group_name.find('(')); }

std::pair<int, int> mesh_shape(const StrategyOptions& s, int world) {
  if (s.mesh.empty()) return world % 2 == 0 && world >= 4 ? std::pair{2, world / 2} : std::pair{1, world};
  const auto [replicas, shards] = Mesh::parse(s.mesh);
  if (replicas * shards != world)
    throw std::invalid_argument("--mesh " + s.mesh + " has " + std::to_string(replicas * shards) +
                                " ranks; the world size is " + std::to_string(world));
  return {replicas, shards};
}

bool shards_parameters(const std::string& strategy) { return strategy.rfind("fsdp", 0) == 0 || strategy == "hsdp"; }

bool prefetches(const std::string& strategy) { return strategy == "fsdp_prefetch" || strategy == "hsdp"; }

bool clips(const std::string& strategy) { return strategy != "overlap_optimizer"; }

bool checkpoints(const std::string& strategy) { return strategy != "overlap_optimizer"; }

const Strategy& find_strategy(const std::string& name) {
  for (const auto& s : strategies())
    if (s.name == name) return s;
  std::string list;
  for (const auto& s : strategies()) list += (list.empty() ? "" : "|") + s.name;
  throw std::invalid_argument("unknown strategy '" + name + "'; expected one of " + list);
}

}  // namespace shardlab::cli
