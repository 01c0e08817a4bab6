#include "shardlab/fsdp/mesh_info.h"

#include <stdexcept>
#include <string>

namespace shardlab::fsdp {

MeshInfo MeshInfo::fsdp(Communicator& shard) { return MeshInfo{&shard, nullptr, nullptr, 0}; }

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
  if (replica < 0 || replica >= replicas())
    throw std::invalid_argument(w + ": expected a replica index in [0, " + std::to_string(replicas()) + "); got " +
                                std::to_string(replica));
}

}  // namespace shardlab::fsdp
