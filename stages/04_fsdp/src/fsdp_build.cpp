// FullyShardedModel's construction: which unit owns each parameter, and the two ways to get there. From a built
// model (broadcast rank 0's state, then shard), or unit by unit from a builder (shard each unit as the model
// registers it; nothing broadcast): Note [Building a model unit by unit] in common, and Note [Sharded construction]
// below.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/progress.h"
#include "shardlab/core/comm/text_gather.h"
#include "shardlab/core/model/model_check.h"
#include "shardlab/naive_ddp/broadcast_state.h"

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <set>
#include <stdexcept>

// Note [Sharded construction]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// FSDP2 shards a model built on the meta device, then materializes only the shards. Here the model is built on the
// CPU one unit at a time (Note [Building a model unit by unit] in common, which says why), and the wrapper takes each
// unit the moment the model registers it: the unit moves to the device, becomes an FsdpUnit (this rank's rows are
// copied in, the registered tensors get 0-byte storage) and its reducer is made, in units() order as before. When
// the builder returns, the parameters left over are the root's, sharded last; then the wrapper is the one the other
// constructor makes, unit for unit and value for value.
//
// What changes is how ranks come to agree. The other constructor broadcasts rank 0's state; here every rank built
// the same values from the same seed, so nothing is broadcast (a broadcast would need the whole model). The
// structure check still runs, after the build: it compares names, sizes and dtypes, which the 0-byte tensors keep.
// A rank whose build threw (a unit FSDP cannot shard, a model that throws) must not leave the others waiting in that
// check until it times out, so the build's outcome is agreed first: one all-gather of every rank's error (empty when
// it built), and every rank throws when any failed. Values that differ because a builder drew them differently are
// not caught (comparing them would need the values); the contract asks for the same builder and seed.

namespace shardlab::fsdp {
namespace {

// A parameter shared by two units: refused (each unit frees its storage on its own schedule).
[[noreturn]] void shared_between_units(const std::string& name, const std::string& other, const std::string& unit_a,
                                       const std::string& unit_b) {
  throw std::invalid_argument("FullyShardedModel: parameter '" + name + "' is also '" + other +
                              "': it belongs to units '" + unit_a + "' and '" + unit_b +
                              "'; a parameter may be sharded in one unit only (register the shared module in one "
                              "unit, or keep it in the root)");
}

// The parameters of `unit`, each tensor once, under its first name in the model ("block0.fc.weight").
std::vector<std::pair<std::string, at::Tensor>> unit_parameters(const Unit& unit) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : unit.module->named_parameters(/*recurse=*/true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.emplace_back(unit.name + "." + item.key(), item.value());
  return out;
}

// The mesh, once MeshInfo::check passed (before any member refers to its groups).
const MeshInfo& checked(const MeshInfo& mesh) {
  mesh.check("FullyShardedModel");
  return mesh;
}

[[noreturn]] void no_parameters(const std::string& unit) {
  throw std::invalid_argument("FullyShardedModel: unit '" + unit +
                              "' has no parameters; register it with register_module instead");
}

}  // namespace

void FullyShardedModel::prepare_options() {
  if (!options_.reducer) options_.reducer = hook_reducers("reduce_scatter");
  if (options_.pool_buffers) pool_ = std::make_unique<BufferPool>();  // CPU buffers only; CUDA has its own cache
}

std::shared_ptr<GradientReducer> FullyShardedModel::make_reducer(const std::string& unit, size_t index) {
  auto reducer = options_.reducer(ReducerRequest{unit, index, mesh_});
  if (!reducer)
    throw std::invalid_argument("FullyShardedModel: Options::reducer gave no reducer for unit '" + unit +
                                "'; expected one per unit");
  return reducer;
}

std::unique_ptr<FsdpUnit> FullyShardedModel::make_unit(const std::string& name,
                                                       const std::vector<std::pair<std::string, at::Tensor>>& params,
                                                       std::shared_ptr<GradientReducer> reducer) {
  return std::make_unique<FsdpUnit>(name, params, comm_, options_.mixed_precision, std::move(reducer), meter_,
                                    pool_.get(), options_.gather);
}

std::vector<std::vector<std::pair<std::string, at::Tensor>>> FullyShardedModel::assign_parameters() {
  // Which unit owns each parameter: the model's units in order, then the root (index = number of units).
  std::vector<Unit>& slots = model_->units();
  const size_t root = slots.size();
  std::map<const c10::TensorImpl*, size_t> unit_of;
  std::map<const c10::TensorImpl*, std::string> name_in_unit;  // its full model name in the unit that came first
  for (size_t u = 0; u < slots.size(); ++u) {
    for (const auto& item : slots[u].module->named_parameters(/*recurse=*/true)) {
      const std::string full = slots[u].name + "." + item.key();
      auto [it, fresh] = unit_of.emplace(item.value().unsafeGetTensorImpl(), u);
      if (fresh) name_in_unit.emplace(item.value().unsafeGetTensorImpl(), full);
      if (!fresh && it->second != u)
        shared_between_units(full, name_in_unit.at(item.value().unsafeGetTensorImpl()), slots[it->second].name,
                             slots[u].name);
    }
  }
  // The unit a registration belongs to, from its name ("block0.fc.weight" is in unit "block0"); the root otherwise.
  auto unit_by_name = [&](const std::string& key) {
    for (size_t u = 0; u < slots.size(); ++u)
      if (key.compare(0, slots[u].name.size() + 1, slots[u].name + ".") == 0) return u;
    return root;
  };
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups(root + 1);
  std::map<const c10::TensorImpl*, std::pair<size_t, size_t>> placed;
  std::map<const c10::TensorImpl*, std::string> first_name;
  order_.clear();
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
    auto found = placed.find(impl);
    if (found == placed.end()) {  // a tensor registered twice is managed once, under its first name
      auto it = unit_of.find(impl);
      const size_t u = it == unit_of.end() ? root : it->second;
      found = placed.emplace(impl, std::make_pair(u, groups[u].size())).first;
      first_name.emplace(impl, item.key());
      groups[u].emplace_back(item.key(), item.value());
    } else if (unit_by_name(item.key()) != unit_by_name(first_name[impl])) {
      // Registered inside a unit and outside it: the outside use would read the unit's freed storage.
      throw std::invalid_argument("FullyShardedModel: parameter '" + first_name[impl] + "' is also registered as '" +
                                  item.key() +
                                  "', in another unit or the root; a unit's parameters are gathered "
                                  "only while that unit runs. Keep a shared parameter in the root (the tiny GPT's "
                                  "tied embedding) or in one unit that all its uses run in");
    }
    order_.push_back(found->second);
  }
  for (size_t u = 0; u < root; ++u)
    if (groups[u].empty()) no_parameters(slots[u].name);
  return groups;
}

FullyShardedModel::FullyShardedModel(std::shared_ptr<Model> model, Communicator& comm, Options options)
    : FullyShardedModel(std::move(model), MeshInfo::fsdp(comm), std::move(options)) {}

FullyShardedModel::FullyShardedModel(const ModelBuilder& build, Communicator& comm, Options options,
                                     const c10::Device& device)
    : FullyShardedModel(build, MeshInfo::fsdp(comm), std::move(options), device) {}

FullyShardedModel::FullyShardedModel(std::shared_ptr<Model> model, const MeshInfo& mesh, Options options)
    : model_(std::move(model)), mesh_(checked(mesh)), comm_(*mesh_.shard), options_(std::move(options)) {
  if (!model_) throw std::invalid_argument("FullyShardedModel: expected a model; got a null pointer");
  // First, over every rank of the mesh (the group that broadcasts): the checks below depend on the model, and a rank
  // must not fail one alone while the others wait. Note [Comparing the ranks' models].
  check_same_model(*model_, mesh_.everyone(), "FullyShardedModel");
  prepare_options();
  auto groups = assign_parameters();
  // Check every unit before changing any: a failure must leave the model as it was.
  std::vector<Unit>& slots = model_->units();
  const size_t root = slots.size();
  for (size_t u = 0; u < root; ++u) FsdpUnit::validate(slots[u].name, groups[u]);
  if (!groups[root].empty()) FsdpUnit::validate("root", groups[root]);
  // One reducer per unit (the root last, when it has parameters), in units() order, before any unit exists.
  has_root_ = !groups[root].empty();
  const size_t count = has_root_ ? root + 1 : root;
  auto unit_name = [&](size_t u) { return u == root ? std::string("root") : slots[u].name; };
  std::vector<std::shared_ptr<GradientReducer>> reducers;
  for (size_t u = 0; u < count; ++u) reducers.push_back(make_reducer(unit_name(u), u));
  // Only now, every check passed on every rank (they see the same structure), do the replicas take rank 0's values.
  naive_ddp::broadcast_state(*model_, mesh_.everyone(), naive_ddp::StructureCheck::kAlreadyCompared);
  for (size_t u = 0; u < count; ++u) units_.push_back(make_unit(unit_name(u), groups[u], std::move(reducers[u])));
  finish_construction();
}

FullyShardedModel::FullyShardedModel(const ModelBuilder& build, const MeshInfo& mesh, Options options,
                                     const c10::Device& device)
    : mesh_(checked(mesh)), comm_(*mesh_.shard), options_(std::move(options)) {
  // Note [Sharded construction]: every rank hears of a build that failed anywhere before the structure check.
  run_agreed(mesh_.everyone(), "FullyShardedModel: building the model", [&] {
    if (!build) throw std::invalid_argument("FullyShardedModel: expected a model builder; got an empty function");
    prepare_options();
    std::map<const c10::TensorImpl*, std::pair<std::string, std::string>> sharded;  // -> (unit, name in it)
    UnitBuildScope scope([&](Unit& unit) {
      if (!device.is_cpu()) unit.module->to(device);
      const auto params = unit_parameters(unit);
      if (params.empty()) no_parameters(unit.name);
      for (const auto& [name, p] : params) {
        auto it = sharded.find(p.unsafeGetTensorImpl());
        if (it != sharded.end()) shared_between_units(name, it->second.second, it->second.first, unit.name);
      }
      FsdpUnit::validate(unit.name, params);
      auto reducer = make_reducer(unit.name, units_.size());
      units_.push_back(make_unit(unit.name, params, std::move(reducer)));
      for (const auto& [name, p] : params) sharded.emplace(p.unsafeGetTensorImpl(), std::make_pair(unit.name, name));
    });
    model_ = build();
    if (!model_) throw std::invalid_argument("FullyShardedModel: the model builder returned a null pointer");
    if (model_->units().size() != units_.size())
      throw std::invalid_argument("FullyShardedModel: the builder's model has " +
                                  std::to_string(model_->units().size()) + " units, of which " +
                                  std::to_string(units_.size()) +
                                  " were registered while it ran; expected a model built inside the builder, every "
                                  "unit registered there (not one built before)");
    if (!device.is_cpu()) {  // the root: what the units did not move
      torch::NoGradGuard no_grad;
      for (const auto& p : model_->parameters(/*recurse=*/true))
        if (!sharded.count(p.unsafeGetTensorImpl())) p.set_data(p.to(device));
      for (const auto& b : model_->buffers(/*recurse=*/true)) b.set_data(b.to(device));
    }
  });
  check_same_model(*model_, mesh_.everyone(), "FullyShardedModel");
  auto groups = assign_parameters();
  const size_t root = model_->units().size();
  for (size_t u = 0; u < root; ++u) {  // what the build sharded is what the finished model assigns
    const auto& built = units_[u]->params();
    bool same = built.size() == groups[u].size();
    for (size_t k = 0; same && k < built.size(); ++k)
      same = built[k].param.unsafeGetTensorImpl() == groups[u][k].second.unsafeGetTensorImpl() &&
             built[k].trainable == groups[u][k].second.requires_grad();
    // The same on every rank (the structures were compared): every rank throws it.
    if (!same)
      throw std::invalid_argument("FullyShardedModel: unit '" + units_[u]->name() +
                                  "' changed after it was "
                                  "registered (a parameter added, replaced or frozen): it was sharded as it was "
                                  "then. Finish each unit, its requires_grad included, before register_unit");
  }
  has_root_ = !groups[root].empty();
  if (has_root_) {
    FsdpUnit::validate("root", groups[root]);
    units_.push_back(make_unit("root", groups[root], make_reducer("root", root)));
  }
  finish_construction();
}

void FullyShardedModel::finish_construction() {
  for (size_t u = 0; u < units_.size(); ++u) {
    units_[u]->set_event_sink([this, u](UnitEventKind kind) {
      const uint64_t seq = events_++;
      if (observer_) observer_(UnitEvent{kind, u, seq});
    });
  }
  std::vector<Unit>& slots = model_->units();
  for (size_t u = 0; u < slots.size(); ++u) {
    inner_forward_.push_back(slots[u].forward);
    slots[u].forward = [this, u](const at::Tensor& x) {
      pre_forward(u);
      progress_point();  // a prefetched all-gather may be in flight: Note [Progress points in forward]
      // Mixed precision: a floating input is cast to the policy's param dtype when one is set (FSDP2's
      // cast_forward_inputs: the policy's dtype, not the unit's clamped one; no policy, no cast).
      const std::optional<c10::ScalarType>& compute = options_.mixed_precision.param_dtype;
      const bool cast = compute && x.defined() && c10::isFloatingType(x.scalar_type()) && x.scalar_type() != *compute;
      at::Tensor y = inner_forward_[u](cast ? x.to(*compute) : x);
      progress_point();
      post_forward(u, y);
      return y;
    };
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& ps = units_[u]->params();
    for (size_t k = 0; k < ps.size(); ++k) {
      if (!ps[k].trainable) continue;
      watched_.push_back(ps[k].param);
      owner_.emplace_back(u, k);
    }
  }
  readiness_ = std::make_unique<GradientReadiness>(
      watched_, [this](size_t g) { on_gradient_ready(g); }, [this] { end_of_backward(); });
  reset_iteration();
  offer_facets();
}

}  // namespace shardlab::fsdp
