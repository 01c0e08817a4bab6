// A replicated wrapper's answers for the full model (parallel_model.h): its own tensors, copied.
#include "shardlab/core/model/parallel_model.h"

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
