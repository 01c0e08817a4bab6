#include "shardlab/fsdp/mesh_info.h"

#include <stdexcept>
#include <string>

namespace shardlab::fsdp {

MeshInfo MeshInfo::fsdp(Communicator& shard) { return MeshInfo{&shard, nullptr, nullptr}; }

void MeshInfo::check(const char* who) const {
  const std::string w = who;
  if (shard == nullptr) throw std::invalid_argument(w + ": expected a MeshInfo with a shard group; got none");
  if ((replicate == nullptr) != (mesh == nullptr))
    throw std::invalid_argument(w + ": expected a MeshInfo with both a replicate group and a mesh group, or " +
                                "neither; got only the " + (replicate != nullptr ? "replicate" : "mesh") + " group");
  if (mesh != nullptr && mesh->size() != shard->size() * replicate->size())
    throw std::invalid_argument(w + ": expected the mesh group to hold R x S = " + std::to_string(replicate->size()) +
                                " x " + std::to_string(shard->size()) + " ranks; it holds " +
                                std::to_string(mesh->size()));
}

}  // namespace shardlab::fsdp
