// FullyShardedModel's checkpoints: its state as rows of the full parameters (checkpoint.h, training_state.h).
#include "shardlab/core/checkpoint/training_state.h"
#include "shardlab/core/errors.h"
#include "shardlab/fsdp/fsdp.h"

#include <set>
#include <stdexcept>

namespace shardlab::fsdp {

std::vector<std::pair<std::string, at::Tensor>> FullyShardedModel::full_state_dict() {
  const std::vector<at::Tensor> full = full_parameters();  // one per registration, as named_parameters lists them
  std::vector<std::pair<std::string, at::Tensor>> out;
  size_t i = 0;
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), full.at(i++));
  SHARDLAB_INTERNAL_ASSERT(i == full.size(), "full_parameters and named_parameters list the registrations alike");
  for (auto& [name, b] : named_state(*model_, StateParts::kBuffers, /*once=*/false)) out.emplace_back(name, b.clone());
  return out;
}

ShardedState FullyShardedModel::checkpoint_state() {
  check_usable("checkpoint_state");
  reshard_all();
  ShardedState state;
  const int rank = comm_.rank();
  const bool saves = mesh_.saves();  // the first replica's ranks: the other replicas hold the same rows
  // A tensor registered twice (tied) is saved once, under its first name; its other names are aliases.
  std::set<std::pair<size_t, size_t>> taken;
  size_t i = 0;
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    const auto [u, k] = order_.at(i++);
    const FsdpParam& p = units_[u]->params()[k];
    if (taken.insert({u, k}).second)
      state.tensors.push_back({p.name, p.sharded, p.spec.sizes, p.spec.first_row_of(rank), saves});
    else
      state.aliases.emplace(item.key(), p.name);
  }
  SHARDLAB_INTERNAL_ASSERT(i == order_.size(), "order_ lists the registrations as named_parameters does");
  for (auto& [name, b] : named_state(*model_, StateParts::kBuffers, /*once=*/true))
    state.tensors.push_back({name, b, b.sizes().vec(), 0, mesh_.everyone().rank() == 0});
  for (auto& [alias, name] : tied_names(*model_, StateParts::kBuffers)) state.aliases.emplace(alias, name);
  return state;
}

void FullyShardedModel::save_checkpoint(const std::string& dir, torch::optim::Optimizer* optimizer,
                                        const std::map<std::string, std::string>& metadata) {
  save_training_checkpoint(dir, checkpoint_state(), optimizer, mesh_.everyone(), metadata);
}

std::map<std::string, std::string> FullyShardedModel::load_checkpoint(const std::string& path,
                                                                      torch::optim::Optimizer* optimizer,
                                                                      bool optimizer_if_saved,
                                                                      const SavedNames& names) {
  return load_training_checkpoint(path, checkpoint_state(), optimizer, mesh_.everyone(), optimizer_if_saved, names);
}

}  // namespace shardlab::fsdp
