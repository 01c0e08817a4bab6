#include "shardlab/core/checkpoint/training_state.h"

#include "shardlab/core/numbers.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace shardlab {

// Note [Optimizer state by name]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// libtorch keys an optimizer's state by the address of the parameter's TensorImpl (a string of it in 1.13, the
// pointer in 2.x), which means nothing in another process. A checkpoint keys it by the parameter's model name
// instead, as PyTorch's distributed checkpoint does (its optimizer state dict is keyed by FQN): the state of
// "block0.fc.weight" is "optim.block0.fc.weight.exp_avg", with the parameter's full sizes and its rows, so it
// reshards to another world size exactly as the parameter does. The tensor the optimizer steps must be the one in
// the wrapper's state (a replica's parameter, or FSDP's sharded parameter); one it steps that the state does not
// hold cannot be named and is refused.
//
// Only the state is saved, not the hyperparameters (learning rate, betas, weight decay): they come from the code
// that builds the optimizer, which a resumed run runs again. A parameter not stepped yet has no state (libtorch
// creates it at the first step, and SGD's first momentum is the gradient itself, not a zero buffer); load gives it
// none again, so the continuation is the same bit for bit.

namespace {

enum class Kind { kSgd, kAdam, kAdamW };

const char* kind_name(Kind k) { return k == Kind::kSgd ? "sgd" : k == Kind::kAdam ? "adam" : "adamw"; }

Kind kind_of(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return Kind::kSgd;
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return Kind::kAdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return Kind::kAdam;
  throw std::invalid_argument(
      "checkpoints hold the state of SGD, Adam and AdamW; this optimizer is another kind (its state's fields "
      "are unknown to shardlab)");
}

// The optimizer's key of parameter `p` (see the Note).
template <typename Map>
typename Map::key_type state_key(const Map& /*state*/, const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << static_cast<const void*>(p.unsafeGetTensorImpl());
    return s.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// The fields of a state and their tensors (defined ones only), and the step count (-1: SGD has none).
struct Fields {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  int64_t step = -1;
};

template <typename S>
Fields adam_fields(const S& s) {
  Fields f;
  f.step = s.step();
  f.tensors = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
  if (s.max_exp_avg_sq().defined()) f.tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  return f;
}

Fields fields_of(Kind kind, torch::optim::OptimizerParamState& state) {
  switch (kind) {
    case Kind::kSgd: {
      Fields f;
      const auto& s = static_cast<torch::optim::SGDParamState&>(state);
      if (s.momentum_buffer().defined()) f.tensors.emplace_back("momentum_buffer", s.momentum_buffer());
      return f;
    }
    case Kind::kAdam:
      return adam_fields(static_cast<torch::optim::AdamParamState&>(state));
    case Kind::kAdamW:
      return adam_fields(static_cast<torch::optim::AdamWParamState&>(state));
  }
  return {};
}

const std::vector<std::string>& field_names(Kind kind) {
  static const std::vector<std::string> sgd = {"momentum_buffer"};
  static const std::vector<std::string> adam = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return kind == Kind::kSgd ? sgd : adam;
}

template <typename S>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam_state(const std::map<std::string, at::Tensor>& t,
                                                                   int64_t step) {
  auto s = std::make_unique<S>();
  s->step(step);
  s->exp_avg(t.at("exp_avg"));
  s->exp_avg_sq(t.at("exp_avg_sq"));
  if (t.count("max_exp_avg_sq")) s->max_exp_avg_sq(t.at("max_exp_avg_sq"));
  return s;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(Kind kind, const std::map<std::string, at::Tensor>& t,
                                                              int64_t step) {
  switch (kind) {
    case Kind::kSgd: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      if (t.count("momentum_buffer")) s->momentum_buffer(t.at("momentum_buffer"));
      return s;
    }
    case Kind::kAdam:
      return make_adam_state<torch::optim::AdamParamState>(t, step);
    case Kind::kAdamW:
      return make_adam_state<torch::optim::AdamWParamState>(t, step);
  }
  return nullptr;
}

// Every distinct parameter the optimizer steps, with the name `state` gives it.
struct Stepped {
  at::Tensor param;
  const StateTensor* model = nullptr;
  size_t group = 0;  // its parameter group
};

// A step count from the metadata. @throws std::runtime_error naming the checkpoint and the key.
int64_t parse_step(const std::string& text, const std::string& path, const std::string& key) {
  const std::optional<int64_t> step = parse_integer(text, 0, std::numeric_limits<int64_t>::max());
  if (!step)
    throw std::runtime_error("checkpoint '" + path + "' has metadata " + key + " '" + text +
                             "', not a step count: a damaged checkpoint");
  return *step;
}

std::vector<Stepped> stepped_parameters(torch::optim::Optimizer& optimizer, const ShardedState& state) {
  std::unordered_map<const void*, const StateTensor*> by_impl;
  for (const StateTensor& t : state.tensors) by_impl.emplace(t.local.unsafeGetTensorImpl(), &t);
  std::vector<Stepped> out;
  std::set<const void*> seen;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const at::Tensor& p = groups[g].params()[i];
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      const auto it = by_impl.find(p.unsafeGetTensorImpl());
      if (it == by_impl.end())
        throw std::invalid_argument("the optimizer steps a tensor (param group " + std::to_string(g) + ", parameter " +
                                    std::to_string(i) + ", sizes " + c10::str(p.sizes()) +
                                    ") that the wrapper's state does not hold: build the optimizer over the "
                                    "wrapper's parameters()");
      out.push_back({p, it->second, g});
    }
  }
  return out;
}

std::string field_key(const std::string& name, const std::string& field) { return "optim." + name + "." + field; }
std::string step_key(const std::string& name) { return "optim." + name + ".step"; }

// Load's half for the optimizer: destinations for what the checkpoint holds, installed once the load succeeded.
class OptimizerLoad {
 public:
  OptimizerLoad(torch::optim::Optimizer& optimizer, bool only_if_saved)
      : optimizer_(optimizer), kind_(kind_of(optimizer)), only_if_saved_(only_if_saved) {}

  void prepare(const CheckpointIndex& index, ShardedState& state) {
    const auto saved = index.metadata.find("optim.kind");
    if (saved == index.metadata.end() && only_if_saved_) {
      skip_ = true;  // weights only: the optimizer stays as it is
      return;
    }
    if (saved == index.metadata.end())
      throw std::invalid_argument("checkpoint '" + index.path +
                                  "' holds no optimizer state (saved without an optimizer); load it without one");
    if (saved->second != kind_name(kind_))
      throw std::invalid_argument("checkpoint '" + index.path + "' holds the state of optimizer '" + saved->second +
                                  "'; this optimizer is '" + kind_name(kind_) + "'");
    // Stepped points into state.tensors: the destinations are appended after the loop.
    const std::vector<Stepped> params = stepped_parameters(optimizer_, state);
    std::vector<StateTensor> added;
    for (const Stepped& s : params) {
      Pending pending{s.param, {}, 0};
      for (const std::string& field : field_names(kind_)) {
        const std::string key = field_key(s.model->name, field);
        if (!index.tensors.count(key)) continue;
        at::Tensor dest = at::empty_like(s.model->local);
        pending.tensors.emplace(field, dest);
        added.push_back({key, dest, s.model->full_sizes, s.model->first_row, s.model->saves});
      }
      const auto step = index.metadata.find(step_key(s.model->name));
      if (kind_ != Kind::kSgd && !pending.tensors.empty()) {
        if (step == index.metadata.end())
          throw std::runtime_error("checkpoint '" + index.path + "' has no step count for '" + s.model->name +
                                   "' (metadata " + step_key(s.model->name) + "): a damaged checkpoint");
        pending.step = parse_step(step->second, index.path, step_key(s.model->name));
      }
      if (kind_ != Kind::kSgd && !pending.tensors.empty() &&
          (!pending.tensors.count("exp_avg") || !pending.tensors.count("exp_avg_sq")))
        throw std::runtime_error("checkpoint '" + index.path + "' has only part of the state of '" + s.model->name +
                                 "' (exp_avg and exp_avg_sq go together): a damaged checkpoint");
      if (!pending.tensors.empty() && amsgrad(s.group) && !pending.tensors.count("max_exp_avg_sq"))
        throw std::invalid_argument("checkpoint '" + index.path + "' holds no max_exp_avg_sq for '" + s.model->name +
                                    "': it was saved without amsgrad, and this optimizer has amsgrad on");
      pending_.push_back(std::move(pending));
    }
    for (StateTensor& t : added) state.tensors.push_back(std::move(t));
  }

  void install() {
    if (skip_) return;
    auto& states = optimizer_.state();
    for (Pending& p : pending_) {
      const auto key = state_key(states, p.param);
      if (p.tensors.empty())
        states.erase(key);
      else
        states[key] = make_state(kind_, p.tensors, p.step);
    }
  }

 private:
  struct Pending {
    at::Tensor param;
    std::map<std::string, at::Tensor> tensors;
    int64_t step;
  };
  // Whether parameter group `g` runs Adam's or AdamW's amsgrad (false for SGD).
  bool amsgrad(size_t g) const {
    const auto& options = optimizer_.param_groups().at(g).options();
    if (kind_ == Kind::kAdam) return static_cast<const torch::optim::AdamOptions&>(options).amsgrad();
    if (kind_ == Kind::kAdamW) return static_cast<const torch::optim::AdamWOptions&>(options).amsgrad();
    return false;
  }

  torch::optim::Optimizer& optimizer_;
  Kind kind_;
  bool only_if_saved_;
  bool skip_ = false;
  std::vector<Pending> pending_;
};

}  // namespace

ShardedState replicated_state(torch::nn::Module& model, int rank) {
  ShardedState state;
  for (auto& [name, t] : named_state(model, StateParts::kParametersAndBuffers, /*once=*/true))
    state.tensors.push_back({name, t, t.sizes().vec(), 0, rank == 0});
  state.aliases = tied_names(model, StateParts::kParametersAndBuffers);
  return state;
}

void add_optimizer_state(ShardedState& state, torch::optim::Optimizer& optimizer) {
  const Kind kind = kind_of(optimizer);
  const auto& states = optimizer.state();
  std::vector<StateTensor> added;
  for (const Stepped& s : stepped_parameters(optimizer, state)) {
    const auto it = states.find(state_key(states, s.param));
    if (it == states.end()) continue;
    const Fields f = fields_of(kind, *it->second);
    for (const auto& [field, t] : f.tensors)
      added.push_back({field_key(s.model->name, field), t, s.model->full_sizes, s.model->first_row, s.model->saves});
    if (f.step >= 0) state.metadata[step_key(s.model->name)] = std::to_string(f.step);
  }
  state.metadata["optim.kind"] = kind_name(kind);
  for (StateTensor& t : added) state.tensors.push_back(std::move(t));
}

void save_training_checkpoint(const std::string& dir, ShardedState model_state, torch::optim::Optimizer* optimizer,
                              Communicator& comm, const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) model_state.metadata[key] = value;
  PrepareSave prepare;  // inside the save's first agreement: a refusal on one rank stops every rank
  if (optimizer) prepare = [optimizer](ShardedState& state) { add_optimizer_state(state, *optimizer); };
  save_checkpoint(dir, model_state, comm, prepare);
}

std::map<std::string, std::string> load_training_checkpoint(const std::string& path, ShardedState model_state,
                                                            torch::optim::Optimizer* optimizer, Communicator& comm,
                                                            bool optimizer_if_saved, const SavedNames& names) {
  std::unique_ptr<OptimizerLoad> load;
  PrepareLoad prepare;
  if (optimizer) {
    load = std::make_unique<OptimizerLoad>(*optimizer, optimizer_if_saved);
    prepare = [&](const CheckpointIndex& index, ShardedState& state) { load->prepare(index, state); };
  }
  // The optimizer's state keeps its names (a file from shardlab: "optim.<the model's name>.<field>"); the user's
  // names map the model's tensors.
  SavedNames model_names;
  if (names)
    model_names = [&names](const std::string& saved) { return saved.rfind("optim.", 0) == 0 ? saved : names(saved); };
  load_checkpoint(path, model_state, comm, optimizer ? "" : "optim.", prepare, model_names);
  if (load) load->install();
  return model_state.metadata;
}

}  // namespace shardlab
