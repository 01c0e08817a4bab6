// A replicated wrapper's answers for the full model (parallel_model.h): its own tensors, copied.
#include "shardlab/core/parallel/parallel_model.h"

// Note [Facets, not downcasts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A loop that trains "any wrapper" still needs what only some wrappers have: FSDP's measured memory, DDP's buckets,
// HSDP's switch for the all-reduce across replicas, and (for a sharded optimizer) a step after the optimizer. Two
// ways to reach them fail as the library grows:
//  - a closed union (an enum of wrapper kinds, `ddp()` / `sharded()` accessors): every new strategy edits the
//    union, the facade and each caller's switch;
//  - downcasts (`dynamic_cast<BucketedDDP*>`): the caller names the wrapper's class, so a facade (parallelize's
//    DataParallel) or a decorator hides what it wraps, and a new wrapper with the same capability is not found.
// So a capability is a *facet*: a type with virtual methods, which a wrapper registers in its constructor
// (`facets_.add<MemoryFacet>(this)`) and a caller asks for by the same type (`wrapper.facet<MemoryFacet>()`, null
// when absent). A facade adopts the facets of what it wraps; an extension that works beside a wrapper attaches
// its own (`attach<StepSeam>(...)`) without editing the wrapper. Lookup is by the static type used at
// registration (std::type_index), so a part is never handed out as a type it was not registered as, and no
// RTTI walk of a class hierarchy is involved.

namespace shardlab {

std::vector<at::Tensor> ReplicatedModel::parameters() const { return trainable_parameters(replica()); }

void ReplicatedModel::visit_full_parameters(const std::function<void(size_t index, const at::Tensor& full)>& visit) {
  const std::vector<at::Tensor> params = replica().parameters();
  for (size_t i = 0; i < params.size(); ++i) visit(i, params[i]);
}

std::vector<at::Tensor> ReplicatedModel::full_parameters() {
  std::vector<at::Tensor> out;
  for (const auto& p : replica().parameters()) out.push_back(p.detach().clone());
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ReplicatedModel::full_state_dict() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, t] : named_state(replica(), StateParts::kParametersAndBuffers, /*once=*/false))
    out.emplace_back(name, t.detach().clone());
  return out;
}

}  // namespace shardlab
