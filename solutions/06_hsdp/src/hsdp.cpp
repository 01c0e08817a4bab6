#include "shardlab/hsdp/hsdp.h"

#include "shardlab/core/errors.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::hsdp {

namespace {

// The options of FSDP on the mesh that make it HSDP, its reducers added to `sync`. @throws as fully_shard_hybrid
// for options HSDP sets.
fsdp::Options hybrid_options(fsdp::Options options, Wire wire, std::shared_ptr<HsdpSwitch> sync) {
  if (options.reducer)
    throw std::invalid_argument(
        "fully_shard_hybrid: expected Options::reducer empty (HSDP reduces with its own HsdpReducer); got one set. "
        "Choose the wire with the `wire` argument");
  options.reducer = hsdp_reducers(wire, std::move(sync));
  return options;
}

// The hybrid wrapper offers its reducers' switch as its ReplicaSync facet (Note [Facets, not downcasts]).
std::unique_ptr<fsdp::FullyShardedModel> with_switch(std::unique_ptr<fsdp::FullyShardedModel> fsdp,
                                                     std::shared_ptr<HsdpSwitch> sync) {
  fsdp->attach<ReplicaSync>(std::move(sync));
  return fsdp;
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
  auto sync = std::make_shared<HsdpSwitch>();
  return with_switch(std::make_unique<fsdp::FullyShardedModel>(std::move(model), mesh_info(mesh),
                                                               hybrid_options(std::move(options), wire, sync)),
                     sync);
}

std::unique_ptr<fsdp::FullyShardedModel> fully_shard_hybrid(const ModelBuilder& build, Mesh& mesh,
                                                            fsdp::Options options, Wire wire,
                                                            const c10::Device& device) {
  auto sync = std::make_shared<HsdpSwitch>();
  return with_switch(std::make_unique<fsdp::FullyShardedModel>(build, mesh_info(mesh),
                                                               hybrid_options(std::move(options), wire, sync), device),
                     sync);
}

void set_requires_all_reduce(fsdp::FullyShardedModel& fsdp, bool requires_all_reduce) {
  auto* sync = fsdp.facet<ReplicaSync>();
  if (sync == nullptr) {
    const std::string units = fsdp.units().empty()
                                  ? "it has no units"
                                  : "its units reduce with '" + fsdp.units().front()->reducer().name() + "' (unit '" +
                                        fsdp.units().front()->name() + "')";
    throw std::invalid_argument(
        "set_requires_all_reduce: expected an HSDP wrapper with its reducers' switch (fully_shard_hybrid attaches it; "
        "by hand: Options::reducer = hsdp_reducers(wire, sync), then attach<ReplicaSync>(sync)); this wrapper has "
        "none, and " +
        units);
  }
  sync->set_requires_all_reduce(requires_all_reduce);
}

}  // namespace shardlab::hsdp
