// A sharded wrapper saves through its own save_checkpoint on any mesh (issue 33): the mesh description says which
// ranks write (the first replica's) and over which group the ranks agree (the whole mesh), so FSDP made by
// parallelize on a 1xN mesh and HSDP on 2x2 both save through the FullyShardedModel they offer (its facet), and another
// wrapper loads it bit for bit.
#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/model_factory.h"
#include "shardlab/course/reference.h"
#include "shardlab/hsdp/parallelize.h"
#include "shardlab/naive_ddp/naive_ddp.h"
#include "support/checkpoint_training.h"
#include "support/group.h"
#include "support/temp_dir.h"
#include "support/train_config.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <utility>
#include <vector>

namespace shardlab {
namespace {

using test_support::TempDir;
using test_support::test_group;

// (replicas, shards) of a 4-rank mesh whose parallelize gives a sharded wrapper.
class MeshSave : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(MeshSave, TheShardedWrapperSavesOneReplicaAndNaiveDdpLoadsItBitForBit) {
  const auto [replicas, shards] = GetParam();
  const std::string shape = std::to_string(replicas) + "x" + std::to_string(shards);
  TempDir dir("mesh_save");
  const TrainConfig c = test_support::mlp_config();
  std::vector<at::Tensor> before;
  run_world(
      replicas * shards,
      [&](World& world) {
        Mesh mesh(world, replicas, shards);
        auto dp = parallelize(make_model(c.model, c.seed), mesh);
        auto* sharded = dp->facet<fsdp::FullyShardedModel>();
        ASSERT_NE(sharded, nullptr) << shape << " gives a sharded wrapper";
        EXPECT_EQ(sharded->mesh_info().replicas(), replicas);
        EXPECT_EQ(sharded->mesh_info().replica(), mesh.replica_index());
        auto opt = make_optimizer("adamw", dp->parameters(), 0.01);
        test_support::train(*dp, *opt, world.world(), c, 0, 1);
        sharded->save_checkpoint(dir / "ckpt", opt.get(), {{"mesh", shape}});  // not DataParallel's
        auto full = dp->full_parameters();
        if (world.rank() == 0) before = full;
      },
      test_group());
  const CheckpointIndex index = read_checkpoint_index(dir / "ckpt");
  EXPECT_EQ(index.files.size(), static_cast<size_t>(shards))
      << shape << ": the first replica's " << shards << " ranks write, the other replicas hold the same rows";
  EXPECT_EQ(index.world_size, replicas * shards) << shape << ": the whole mesh agreed on the save";
  EXPECT_EQ(index.metadata.at("mesh"), shape);
  test_support::expect_naive_ddp_loads(dir / "ckpt", c, 2, before, shape);
}

INSTANTIATE_TEST_SUITE_P(Meshes, MeshSave, ::testing::Values(std::make_pair(1, 4), std::make_pair(2, 2)),
                         [](const auto& info) {
                           return std::to_string(info.param.first) + "x" + std::to_string(info.param.second);
                         });

}  // namespace
}  // namespace shardlab
