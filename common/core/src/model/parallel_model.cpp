// A replicating wrapper's answers for the full model (parallel_model.h): its own tensors, copied.
#include "shardlab/core/model/parallel_model.h"

namespace shardlab {

std::vector<at::Tensor> replica_full_parameters(const Model& model) {
  std::vector<at::Tensor> out;
  for (const auto& p : model.parameters()) out.push_back(p.detach().clone());
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> replica_full_state_dict(const Model& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, t] : named_state(model, StateParts::kParametersAndBuffers, /*once=*/false))
    out.emplace_back(name, t.detach().clone());
  return out;
}

void visit_replica_parameters(const Model& model,
                              const std::function<void(size_t index, const at::Tensor& full)>& visit) {
  const std::vector<at::Tensor> params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) visit(i, params[i]);
}

}  // namespace shardlab
