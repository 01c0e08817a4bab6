#include "shardlab/core/model/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <unordered_map>
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

// Note [Building a model unit by unit]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// FSDP exists for models larger than one rank's memory, so no rank may build the whole model first. PyTorch's FSDP2
// users build on the meta device (no storage), call fully_shard, then `to_empty` and `reset_parameters` (or load a
// checkpoint into the shards). That recipe does not carry over to libtorch 1.13: torch::nn modules take no tensor
// options and allocate CPU storage in their constructors (Linear's reset() makes its weight and initializes it at
// once), so a meta-device build would need every module, the user's included, rewritten to take options and to
// initialize again later. Initializing after sharding has a second problem: to give one device's values, a rank
// that keeps rows 10..19 of a weight must draw what the generator gives those rows, and the CPU generator is a
// sequence (no counter-based offsets, as DTensor's random ops have on CUDA): it has to draw the rows before them.
//
// So the model is built one unit at a time instead. The constructor builds a unit, initializes it and registers it;
// `register_unit` hands it to the wrapper (UnitBuildScope), which copies this rank's rows into its shard and gives
// the registered tensors 0-byte storage; then the next unit is built. The peak is the shards so far plus about two
// units (the one being built, and its gathered buffer, which the steady state holds anyway), whatever the model's
// size, and no module needs to change: a user's model only initializes each unit before
// registering it. Every rank draws every value, in one device's order, and keeps its own rows, so the values are
// one device's at every world size and mesh shape, and ranks agree with no broadcast. The price is the CPU time of
// initializing the whole model on every rank, which one device pays too.
//
// Initializer keeps the draws in one device's order: one generator, each part filled as it is built. Filled in the
// order the finished model lists its parameters, it gives what init_parameters(model, seed) gives. That order is
// libtorch's: a module's own parameters before its children's (so the edge model registers and fills its own two
// first, then its units). A part's buffers are drawn after its parameters, while init_parameters draws every buffer
// after every parameter: they agree while no part with buffers comes before a part with parameters, as in the
// shipped models. The test Initializer.PartByPartDrawsWhatTheWholeModelDraws holds them to it. torch::nn's own
// initialization draws from the global generator: the same in every process seeded alike, but shared between ranks that
// are threads.
//
// What stays whole: the root (parameters outside every unit), built by the model's constructor around the units.
// Keep what is large in units.

namespace {

thread_local const UnitBuilt* t_unit_built = nullptr;  // the live UnitBuildScope's function on this thread

std::vector<std::pair<std::string, at::Tensor>> pairs(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : dict) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace

UnitBuildScope::UnitBuildScope(UnitBuilt on_unit) {
  if (t_unit_built != nullptr)
    throw std::logic_error("UnitBuildScope: a scope already lives on this thread; sharded constructions do not nest");
  t_unit_built = new UnitBuilt(std::move(on_unit));
}

UnitBuildScope::~UnitBuildScope() {
  delete t_unit_built;
  t_unit_built = nullptr;
}

void UnitBuildScope::unit_registered(Unit& unit) {
  if (t_unit_built != nullptr) (*t_unit_built)(unit);
}

void Initializer::fill_tensors(const std::vector<std::pair<std::string, at::Tensor>>& params,
                               const std::vector<at::Tensor>& buffers) {
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : params) {
    if (!filled_.insert(p.unsafeGetTensorImpl()).second) continue;  // a tied weight's second name: drawn once
    keep_.push_back(p);
    if (p.dim() >= 2) {
      p.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(p.size(1))), gen_);
    } else if (ends_with(name, "bias")) {
      p.zero_();
    } else if (ends_with(name, "weight")) {  // LayerNorm gain
      p.fill_(1.0);
    } else {
      p.normal_(0.0, 0.1, gen_);
    }
  }
  for (const auto& b : buffers) {
    if (!filled_.insert(b.unsafeGetTensorImpl()).second) continue;
    keep_.push_back(b);
    if (at::isFloatingType(b.scalar_type())) b.uniform_(0.5, 1.5, gen_);
  }
}

Initializer::Initializer(uint64_t seed) : gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

void Initializer::fill(torch::nn::Module& module) {
  fill_tensors(pairs(module.named_parameters(/*recurse=*/true)), module.buffers(/*recurse=*/true));
}

void Initializer::fill_root(Model& model) {
  std::unordered_set<const void*> in_units = filled_;  // skipped: the units' tensors, and what was filled before
  for (const Unit& unit : model.units()) {
    for (const auto& p : unit.module->parameters(/*recurse=*/true)) in_units.insert(p.unsafeGetTensorImpl());
    for (const auto& b : unit.module->buffers(/*recurse=*/true)) in_units.insert(b.unsafeGetTensorImpl());
  }
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<at::Tensor> buffers;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    if (!in_units.count(item.value().unsafeGetTensorImpl())) params.emplace_back(item.key(), item.value());
  for (const auto& b : model.buffers(/*recurse=*/true))
    if (!in_units.count(b.unsafeGetTensorImpl())) buffers.push_back(b);
  fill_tensors(params, buffers);
}

void init_parameters(torch::nn::Module& module, uint64_t seed) { Initializer(seed).fill(module); }

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

std::map<std::string, std::string> tied_names(const torch::nn::Module& module, StateParts parts) {
  std::map<std::string, std::string> out;
  std::unordered_map<const void*, std::string> first;
  for (const auto& [name, t] : named_state(module, parts, /*once=*/false)) {
    const auto [it, fresh] = first.emplace(t.unsafeGetTensorImpl(), name);
    if (!fresh) out.emplace(name, it->second);
  }
  return out;
}

std::vector<at::Tensor> trainable_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (auto& [name, p] : named_state(model, StateParts::kParameters, /*once=*/true))
    if (p.requires_grad()) out.push_back(p);
  return out;
}

}  // namespace shardlab
