// A state checked on its own and matched with a checkpoint. Before a save or a load does anything, each rank checks
// its state alone (names unique, every local tensor a piece of its full sizes, aliases naming a tensor of the
// state). A load then decides, before reading any byte, which saved tensor fills which tensor of the state: after
// the user's renaming (SavedNames), the state's aliases and a skipped prefix, every state tensor must be found with
// its dtype and full sizes, no saved tensor may be left over, and a tied weight may be found under several names
// (Note [A tied weight in a file]).

#include "detail/checkpoint_internal.h"

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/checkpoint/safetensors.h"

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab {

// Checks one rank's state on its own: names unique, every local a piece of its full sizes.
void detail::check_state(const ShardedState& state) {
  check_format_key(state.metadata);
  std::set<std::string> names;
  for (const StateTensor& t : state.tensors) {
    if (t.name.empty() || !names.insert(t.name).second)
      throw std::invalid_argument("the state has an empty or repeated tensor name '" + t.name + "'");
    if (!t.local.defined()) throw std::invalid_argument("state tensor '" + t.name + "' is undefined");
    safetensors::dtype_name(t.local.scalar_type());  // throws for a dtype the format cannot hold
    const std::vector<int64_t> want = piece_sizes(t.full_sizes, local_rows(t));
    if (t.local.sizes().vec() != want || t.first_row < 0 || t.first_row + local_rows(t) > rows_in(t.full_sizes))
      throw std::invalid_argument("state tensor '" + t.name + "' holds sizes " + sizes_text(t.local.sizes().vec()) +
                                  " from row " + std::to_string(t.first_row) + ", which is not a piece of its full " +
                                  "sizes " + sizes_text(t.full_sizes));
  }
  for (const auto& [alias, name] : state.aliases)
    if (names.count(alias) || !names.count(name))
      throw std::invalid_argument("the state's alias '" + alias + "' -> '" + name +
                                  "' must name a tensor of the state by another name");
}

// Note [A tied weight in a file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor registered under several names (ShardedState::aliases) is saved once, under its first name, as
// named_state lists it. Other writers choose otherwise: Hugging Face's safetensors.torch.save_model keeps the
// name that sorts first (GPT-2's `lm_head.weight`, not `transformer.wte.weight`), and a plain state_dict holds
// every name. So a load takes a tied weight under any of its names, or under several: each rank then reads its
// rows under every name it was saved under and compares them bit for bit, since a file whose copies differ is not
// one tensor (which copy would be the weight?). Which saved names are which model tensor is decided before any
// byte is read, after the user's renaming (SavedNames) and then the aliases; two saved tensors that land on one
// model tensor without being its tie are refused by name.

// For each tensor of `state`, the names in the checkpoint that hold it (one, or several for a tie saved under
// several names); throws std::invalid_argument naming the first difference.
std::vector<std::vector<std::string>> detail::match(const CheckpointIndex& index, const ShardedState& state,
                                                    const std::string& skip_prefix, const SavedNames& names) {
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < state.tensors.size(); ++i) position.emplace(state.tensors[i].name, i);
  std::vector<std::vector<std::string>> sources(state.tensors.size());
  std::map<std::string, std::string> taken_as;  // model name -> the saved name that took it
  std::string extra;                            // the first saved tensor the model does not have
  for (const auto& [saved, info] : index.tensors) {
    const std::string model_name = names ? names(saved) : saved;
    if (model_name.empty()) continue;
    const auto alias = state.aliases.find(model_name);
    const std::string name = alias == state.aliases.end() ? model_name : alias->second;
    const auto it = position.find(name);
    if (it == position.end()) {
      const bool skipped = !skip_prefix.empty() && model_name.rfind(skip_prefix, 0) == 0;
      if (!skipped && extra.empty())  // reported after the missing ones, which say more
        extra = "checkpoint '" + index.path + "' holds tensor '" + saved + "'" +
                (model_name != saved ? " (named '" + model_name + "' for this model)" : "") +
                ", which this model does not have: saved from another model?";
      continue;
    }
    const auto [prior, fresh] = taken_as.emplace(model_name, saved);
    if (!fresh)
      throw std::invalid_argument("checkpoint '" + index.path + "' holds '" + prior->second + "' and '" + saved +
                                  "', which are both named '" + model_name + "' for this model");
    const StateTensor& t = state.tensors[it->second];
    if (info.dtype != t.local.scalar_type() || info.sizes != t.full_sizes)
      throw std::invalid_argument("checkpoint '" + index.path + "' holds '" + saved + "' as " +
                                  safetensors::dtype_name(info.dtype) + " " + sizes_text(info.sizes) +
                                  "; this model has " + (name != saved ? "'" + name + "' as " : "") +
                                  safetensors::dtype_name(t.local.scalar_type()) + " " + sizes_text(t.full_sizes));
    sources[it->second].push_back(saved);
  }
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (!sources[i].empty()) continue;
    const std::string& name = state.tensors[i].name;
    std::string tied;
    for (const auto& [alias, of] : state.aliases)
      if (of == name) tied += (tied.empty() ? "" : "', '") + alias;
    throw std::invalid_argument("checkpoint '" + index.path + "' has no tensor '" + name + "'" +
                                (tied.empty() ? "" : " (nor its tied names '" + tied + "')") +
                                (names ? " under the names given for its tensors" : "") + " (it holds " +
                                std::to_string(index.tensors.size()) + " tensors): saved from another model?");
  }
  if (!extra.empty()) throw std::invalid_argument(extra);
  return sources;
}

}  // namespace shardlab
