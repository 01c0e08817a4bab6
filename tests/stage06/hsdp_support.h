#pragma once
// What the files of stage 06's suite share: the shapes of a 4-rank mesh and the wrapper parallelize() picks for each,
// told from what the wrapper offers and sends.

#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/parallel/parallel_model.h"
#include "shardlab/core/parallel/standard_facets.h"

#include <string>
#include <vector>

namespace shardlab::test_support {

/// A mesh of `replicate` x `shard` ranks and the wrapper parallelize() gives it (kind_of): "ddp" for shard size 1,
/// "fsdp" for one replica, "hsdp" otherwise.
struct MeshShape {
  int replicate, shard;
  const char* kind;
};

/// Which wrapper `dp` is, told from its facets (Note [Facets, not downcasts]) and from `steps`, the collectives a rank
/// sent while it trained: "ddp" offers its buckets, no measured memory and no replicas' switch, and only all-reduces;
/// "fsdp" offers measured memory and the switch, gathers and reduce-scatters, and never all-reduces; "hsdp" is
/// "fsdp" that also all-reduces (across replicas). Anything else is described, so a test prints what it saw.
inline std::string kind_of(ParallelModel& dp, const std::vector<CollectiveRecord>& steps) {
  const bool buckets = dp.facet<bucketed_ddp::BucketedDDP>() != nullptr;
  const bool memory = dp.facet<MemoryFacet>() != nullptr;
  const bool sync = dp.facet<ReplicaSync>() != nullptr;
  bool gathers = false, reduce_scatters = false, all_reduces = false;
  for (const auto& r : steps) {
    gathers = gathers || r.op == "all_gather";
    reduce_scatters = reduce_scatters || r.op == "reduce_scatter";
    all_reduces = all_reduces || r.op == "all_reduce";
  }
  if (buckets && !memory && !sync && !gathers && !reduce_scatters && all_reduces) return "ddp";
  if (!buckets && memory && sync && gathers && reduce_scatters) return all_reduces ? "hsdp" : "fsdp";
  auto yes = [](bool b) { return b ? "yes" : "no"; };
  return std::string("none of them: buckets ") + yes(buckets) + ", measured memory " + yes(memory) +
         ", replicas' switch " + yes(sync) + "; sent all-gathers " + yes(gathers) + ", reduce-scatters " +
         yes(reduce_scatters) + ", all-reduces " + yes(all_reduces);
}

}  // namespace shardlab::test_support
