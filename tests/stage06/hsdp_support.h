#pragma once
// What the files of stage 06's suite share: the shapes of a 4-rank mesh and the wrapper parallelize() picks for each.

namespace shardlab::test_support {

/// A mesh of `replicate` x `shard` ranks and the kind parallelize() gives it (DataParallel::kind_name()): "ddp" for
/// shard size 1, "fsdp" for one replica, "hsdp" otherwise.
struct MeshShape {
  int replicate, shard;
  const char* kind;
};

}  // namespace shardlab::test_support
