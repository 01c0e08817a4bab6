#include "shardlab/hsdp/hsdp.h"

#include "shardlab/core/errors.h"

#include <stdexcept>
#include <utility>
#include <vector>

namespace shardlab::hsdp {

namespace {

// The options of FSDP on the mesh that make it HSDP. @throws as fully_shard_hybrid for options HSDP sets.
fsdp::Options hybrid_options(fsdp::Options options, Wire wire) {
  if (options.reducer)
    throw std::invalid_argument(
        "fully_shard_hybrid: expected Options::reducer empty (HSDP reduces with its own HsdpReducer); got one set. "
        "Choose the wire with the `wire` argument");
  options.reducer = hsdp_reducers(wire);
  return options;
}

}  // namespace

fsdp::MeshInfo mesh_info(Mesh& mesh) {
  // BEGIN SOLUTION(06): sharded over the row, replicated over the column, every rank of the world agreeing
  return fsdp::MeshInfo{&mesh.shard_group(), &mesh.replicate_group(), &mesh.world().world()};
  // END SOLUTION
}

std::unique_ptr<fsdp::FullyShardedModel> fully_shard_hybrid(std::shared_ptr<Model> model, Mesh& mesh,
                                                            fsdp::Options options, Wire wire) {
  if (!model) throw std::invalid_argument("fully_shard_hybrid: expected a model; got a null pointer");
  return std::make_unique<fsdp::FullyShardedModel>(std::move(model), mesh_info(mesh),
                                                   hybrid_options(std::move(options), wire));
}

std::unique_ptr<fsdp::FullyShardedModel> fully_shard_hybrid(const ModelBuilder& build, Mesh& mesh,
                                                            fsdp::Options options, Wire wire,
                                                            const c10::Device& device) {
  return std::make_unique<fsdp::FullyShardedModel>(build, mesh_info(mesh), hybrid_options(std::move(options), wire),
                                                   device);
}

void set_requires_all_reduce(fsdp::FullyShardedModel& fsdp, bool requires_all_reduce) {
  std::vector<HsdpReducer*> reducers;
  for (const auto& unit : fsdp.units()) {
    auto* hsdp = dynamic_cast<HsdpReducer*>(&unit->reducer());
    if (hsdp == nullptr)
      throw std::invalid_argument("set_requires_all_reduce: unit '" + unit->name() + "' reduces with '" +
                                  unit->reducer().name() + "'; expected an HSDP wrapper (fully_shard_hybrid)");
    reducers.push_back(hsdp);
  }
  for (HsdpReducer* r : reducers) r->set_requires_all_reduce(requires_all_reduce);
}

}  // namespace shardlab::hsdp
