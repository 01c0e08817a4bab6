// Stage 06 — parallelize from a ModelBuilder (sharded construction): FSDP and HSDP build the model unit by unit and
// broadcast nothing, DDP builds it whole; every mesh shape trains like one device. (Given code, tested where it meets
// the stage's task: the FSDP and HSDP shapes fail on the starter, so the test does.)
#include "shardlab/hsdp/parallelize.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/course/reference.h"

#include "stage06/hsdp_support.h"
#include "support/group.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>

namespace shardlab {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

TEST(ParallelizeShardedBuild, EveryMeshShapeTrainsLikeOneDeviceAndOnlyDdpBroadcasts) {
  TrainConfig c = test_support::config("tiny_gpt").steps(2).global_batch(8).seed(23);
  const ReferenceResult ref = train_reference(c);
  {  // DDP builds whole; a rank whose builder throws (here with an empty message) stops every rank, none waits
    std::vector<std::string> errors(2);
    run_world(
        2,
        [&](World& world) {
          Mesh mesh(world, 2, 1);
          try {
            parallelize(
                [&]() -> std::shared_ptr<Model> {
                  if (world.rank() == 1) throw std::runtime_error("");
                  return make_model(c, at::kCPU);
                },
                mesh);
            ADD_FAILURE() << "rank " << world.rank() << " went on";
          } catch (const std::exception& e) {
            errors[world.rank()] = e.what();
          }
        },
        test_group());
    std::cout << "rank 0: " << errors[0] << "\n";
    EXPECT_NE(errors[0].find("building the model failed on rank 1, so no rank goes on: an exception with an empty"),
              std::string::npos)
        << errors[0];
  }
  for (const MeshShape& shape : {MeshShape{1, 4, "fsdp"}, MeshShape{2, 2, "hsdp"}, MeshShape{4, 1, "ddp"}}) {
    std::vector<std::vector<at::Tensor>> finals(4);
    std::vector<int> broadcasts(4, 0), builds(4, 0);
    run_world(
        4,
        [&](World& world) {
          Mesh mesh(world, shape.replicate, shape.shard);
          const size_t mark = world.recorder().size();
          try {  // refused before any collective
            parallelize(ModelBuilder{}, mesh);
            ADD_FAILURE() << "an empty builder was accepted";
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("expected a model builder"), std::string::npos) << e.what();
          }
          auto dp = parallelize(
              [&] {
                ++builds[world.rank()];
                return make_model(c, at::kCPU);
              },
              mesh);
          for (const auto& r : world.recorder().since(mark)) broadcasts[world.rank()] += r.op == "broadcast";
          const size_t trained = world.recorder().size();
          test_support::train_steps(world.world(), c, dp->parameters(), at::kCPU, *dp);
          EXPECT_EQ(kind_of(*dp, world.recorder().since(trained)), shape.kind) << mesh.to_string();
          finals[world.rank()] = on_cpu(dp->full_parameters());
        },
        test_group());
    for (int r = 0; r < 4; ++r) {
      const double diff = max_abs_diff(finals[r], ref.params);
      std::cout << shape.kind << " rank " << r << ": " << broadcasts[r]
                << " broadcasts at construction, max |param - one device| = " << diff << "\n";
      EXPECT_EQ(builds[r], 1) << "the builder runs once per rank";
      EXPECT_TRUE(all_close(finals[r], ref.params, 1e-5, 1e-6))
          << shape.kind << " rank " << r << " differs by " << diff;
      if (std::string(shape.kind) == "ddp")
        EXPECT_GT(broadcasts[r], 0) << "DDP builds whole and broadcasts as always";
      else
        EXPECT_EQ(broadcasts[r], 0) << shape.kind << " built sharded: nothing to broadcast";
    }
  }
}

}  // namespace
}  // namespace shardlab
