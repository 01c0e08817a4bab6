// Stage 06's entry point, given code: what its policy decides without any of the stage's tasks (DDP's buckets, and
// what a mesh cannot do, refused before any collective). Its own label, stage06_given (as stage05_given): these pass
// against the starter, so tools/check-starter, which requires every `^stage06$` test to fail there, does not run them;
// `ctest -L stage06` does.
#include "shardlab/bucketed_ddp/auto_caps.h"
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/parallel/standard_facets.h"
#include "shardlab/course/reference.h"
#include "shardlab/fsdp/gather.h"
#include "shardlab/hsdp/parallelize.h"

#include "support/group.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace shardlab {
namespace {

using test_support::on_cpu;
using test_support::test_group;

// ParallelPolicy::buckets reaches DDP: the caps lay the buckets out, the reducer factory is handed the mesh's
// replicate group and reduces every bucket of every step, and auto caps give the facets AutoCaps and StepSeam (one
// object), which tunes after step 2 when the loop calls the seam. Without auto caps neither facet is there. The run
// trains like one device through the custom reducer.
TEST(ParallelizePolicy, DdpsBucketsFollowThePolicysCapsReducerAndAutoCaps) {
  const TrainConfig c = test_support::config("tiny_gpt").steps(3).global_batch(8).seed(37);
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> finals(2);
  std::atomic<int> reductions{0};
  run_world(
      2,
      [&](World& world) {
        Mesh mesh(world, 2, 1);
        ParallelPolicy policy;
        policy.buckets.caps = {2 << 10, 4 << 10};
        policy.buckets.auto_caps = true;
        Communicator* given = nullptr;
        policy.buckets.reducer = [&](Communicator& group) -> bucketed_ddp::BucketReducer {
          given = &group;
          return [&reductions](Communicator& comm, const at::Tensor& bucket) {
            ++reductions;
            return comm.all_reduce(bucket, ReduceOp::kAvg);
          };
        };
        auto dp = parallelize(make_model(c, at::kCPU), mesh, policy);
        EXPECT_EQ(given, &mesh.replicate_group()) << "the factory is handed the replicate group";
        auto* ddp = dp->facet<bucketed_ddp::BucketedDDP>();
        ASSERT_NE(ddp, nullptr) << "a 2x1 mesh gives DDP";
        EXPECT_EQ(ddp->caps().first_bytes, 2 << 10);
        EXPECT_EQ(ddp->caps().bytes, 4 << 10);
        const size_t buckets = ddp->buckets().size();
        EXPECT_GT(buckets, 2u) << "caps of 2 and 4 KiB split the tiny GPT";
        auto* tuner = dp->facet<bucketed_ddp::AutoCaps>();
        ASSERT_NE(tuner, nullptr);
        ASSERT_EQ(static_cast<StepSeam*>(tuner), dp->facet<StepSeam>()) << "the tuner is the step seam";
        test_support::train_steps(world.world(), c, dp->parameters(), at::kCPU, *dp, [&](int step) {
          dp->facet<StepSeam>()->after_optimizer_step();
          EXPECT_EQ(tuner->choice().has_value(), step >= 1) << "tuned after step 2, not before";
        });
        finals[world.rank()] = on_cpu(dp->full_parameters());
        if (world.rank() == 0)
          std::cout << buckets << " buckets with the policy's caps; auto chose " << ddp->caps().first_bytes << " and "
                    << ddp->caps().bytes << " bytes: " << ddp->buckets().size() << " buckets\n";
        ParallelPolicy plain;
        auto untuned = parallelize(make_model(c, at::kCPU), mesh, plain);
        EXPECT_EQ(untuned->facet<bucketed_ddp::AutoCaps>(), nullptr) << "no auto caps: no tuner";
        EXPECT_EQ(untuned->facet<StepSeam>(), nullptr) << "no auto caps: nothing after the step";
      },
      test_group());
  EXPECT_GE(reductions.load(), 2 * 3 * 2) << "the policy's reducer reduces every bucket (at least 2) of 3 steps";
  test_support::expect_ranks_match(finals, ref.params, "ddp through the policy's reducer");
}

// What a mesh's shape cannot do with a policy is refused before any collective, with an error that names the mesh
// and what was expected: a bucket reducer beside a compressed wire and a gather seam (DDP), buckets on a sharded
// mesh, and sharding that stage 07 builds.
TEST(ParallelizePolicy, WhatTheMeshCannotDoIsRefusedBeforeAnyCollective) {
  const TrainConfig c = test_support::config("mlp").seed(43);
  run_world(
      2,
      [&](World& world) {
        auto refused = [&](Mesh& mesh, const ParallelPolicy& policy, const std::string& says) {
          const size_t mark = world.recorder().size();
          try {
            parallelize(make_model(c, at::kCPU), mesh, policy);
            ADD_FAILURE() << mesh.to_string() << ": accepted; expected an error saying '" << says << "'";
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
          }
          EXPECT_EQ(world.recorder().size(), mark) << mesh.to_string() << ": a collective before the refusal";
        };
        Mesh ddp(world, 2, 1), fsdp(world, 1, 2);
        ParallelPolicy two_wires;
        two_wires.reduction.wire = Wire::kFloat16;
        two_wires.buckets.reducer = [](Communicator&) {
          return bucketed_ddp::BucketReducer(
              [](Communicator& comm, const at::Tensor& b) { return comm.all_reduce(b, ReduceOp::kAvg); });
        };
        refused(ddp, two_wires, "2x1 mesh gives DDP, whose buckets the policy's bucket reducer reduces");
        ParallelPolicy gather;
        gather.gather = fsdp::cast_gather();
        refused(ddp, gather, "2x1 mesh gives DDP, which gathers nothing");
        ParallelPolicy buckets;
        buckets.buckets.auto_caps = true;
        refused(fsdp, buckets, "1x2 mesh (shard size > 1) gives FSDP or HSDP, which reduce unit by unit");
        ParallelPolicy caps;
        caps.buckets.caps = {1 << 10, 1 << 10};
        refused(fsdp, caps, "not in buckets");
        ParallelPolicy zero2;
        zero2.sharding = Sharding::kGradients;
        refused(fsdp, zero2, "(ZeRO-2) is stage 07's, not built yet");
        ParallelPolicy zero1;
        zero1.sharding = Sharding::kOptimizerState;
        refused(fsdp, zero1, "(ZeRO-1) is stage 07's, not built yet");
      },
      test_group());
}

}  // namespace
}  // namespace shardlab
