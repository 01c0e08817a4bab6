#include "shardlab/hsdp/hsdp.h"

#include "shardlab/common/errors.h"
#include "shardlab/naive_ddp/broadcast_state.h"

#include <stdexcept>
#include <utility>

namespace shardlab::hsdp {

std::unique_ptr<fsdp::FullyShardedModel> fully_shard_hybrid(std::shared_ptr<Model> model, Mesh& mesh,
                                                            fsdp::Options options, Wire wire) {
  if (!model) throw std::invalid_argument("fully_shard_hybrid: expected a model; got a null pointer");
  if (options.reducer)
    throw std::invalid_argument(
        "fully_shard_hybrid: expected Options::reducer empty (HSDP reduces with its own HsdpReducer); got one set. "
        "Choose the wire with the `wire` argument");
  // TODO(stage06): every replica from global rank 0's values, then FSDP in the row with HSDP's reducers
  throw ::shardlab::NotImplemented("06", "every replica from global rank 0's values, then FSDP in the row with HSDP's reducers");
}

}  // namespace shardlab::hsdp
