// The library's one wrapper interface (core/parallel/parallel_model.h): a training loop that knows only ParallelModel
// trains every wrapper of the course like one device, and each wrapper answers for the full model alike, whether its
// parameters are visited one at a time, copied, or named in the state dict. (Given code, tested where it meets the
// stage's task: parallelize's sharded shapes fail on the starter, so the test does.)
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/parallel/parallel_model.h"
#include "shardlab/core/storage/buffer_pool.h"
#include "shardlab/course/reference.h"
#include "shardlab/fsdp/fsdp.h"
#include "shardlab/hsdp/parallelize.h"
#include "shardlab/naive_ddp/naive_ddp.h"

#include "support/group.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace shardlab {
namespace {

using test_support::on_cpu;
using test_support::test_group;

// What one rank's run through the interface left: every parameter full, by each of the three ways to ask.
struct FullModel {
  std::vector<at::Tensor> visited;                        // visit_full_parameters, copied during each call
  std::vector<at::Tensor> copied;                         // full_parameters
  std::vector<std::pair<std::string, at::Tensor>> state;  // full_state_dict
};

// Trains through `w` with nothing but ParallelModel's methods (the optimizer over w.parameters(), micro-batches under
// no_sync, clipping), then asks it for the full model.
FullModel train_through_the_interface(Communicator& comm, const TrainConfig& c, ParallelModel& w) {
  test_support::train_steps(comm, c, w.parameters(), at::kCPU, w);
  FullModel out;
  w.visit_full_parameters([&out](size_t index, const at::Tensor& full) {
    EXPECT_EQ(index, out.visited.size()) << "visited out of registration order";
    out.visited.push_back(full.detach().cpu().clone());
  });
  out.copied = on_cpu(w.full_parameters());
  out.state = w.full_state_dict();
  return out;
}

// A wrapper of the course, made on every rank of a world of 4 (its model already built).
struct Wrapping {
  const char* name;
  std::function<std::unique_ptr<ParallelModel>(std::shared_ptr<Model>, World&, std::unique_ptr<Mesh>&)> wrap;
};

TEST(ParallelModelInterface, OneLoopTrainsEveryWrapperLikeOneDeviceAndEachAnswersForTheFullModelAlike) {
  const TrainConfig c =
      test_support::config("tiny_gpt").steps(2).global_batch(8).micro_batches(2).clip_norm(0.5).seed(29);
  const ReferenceResult ref = train_reference(c);
  const std::vector<Wrapping> wrappings{
      {"naive_ddp",
       [](std::shared_ptr<Model> m, World& world, std::unique_ptr<Mesh>&) -> std::unique_ptr<ParallelModel> {
         return std::make_unique<naive_ddp::NaiveDDP>(std::move(m), world.world());
       }},
      {"bucketed_ddp",
       [](std::shared_ptr<Model> m, World& world, std::unique_ptr<Mesh>&) -> std::unique_ptr<ParallelModel> {
         return std::make_unique<bucketed_ddp::BucketedDDP>(std::move(m), world.world());
       }},
      {"fsdp",
       [](std::shared_ptr<Model> m, World& world, std::unique_ptr<Mesh>&) -> std::unique_ptr<ParallelModel> {
         return std::make_unique<fsdp::FullyShardedModel>(std::move(m), world.world());
       }},
      {"parallelize 1x4 (fsdp)",
       [](std::shared_ptr<Model> m, World& world, std::unique_ptr<Mesh>& mesh) -> std::unique_ptr<ParallelModel> {
         mesh = std::make_unique<Mesh>(world, 1, 4);
         return parallelize(std::move(m), *mesh);
       }},
      {"parallelize 4x1 (ddp)",
       [](std::shared_ptr<Model> m, World& world, std::unique_ptr<Mesh>& mesh) -> std::unique_ptr<ParallelModel> {
         mesh = std::make_unique<Mesh>(world, 4, 1);
         return parallelize(std::move(m), *mesh);
       }},
      {"parallelize 2x2 (hsdp)",
       [](std::shared_ptr<Model> m, World& world, std::unique_ptr<Mesh>& mesh) -> std::unique_ptr<ParallelModel> {
         mesh = std::make_unique<Mesh>(world, 2, 2);
         return parallelize(std::move(m), *mesh);
       }},
  };
  for (const Wrapping& wrapping : wrappings) {
    std::vector<FullModel> runs(4);
    std::vector<std::vector<std::string>> model_names(4);
    run_world(
        4,
        [&](World& world) {
          auto model = make_model(c, at::kCPU);
          for (const auto& [name, t] : named_state(*model, StateParts::kParametersAndBuffers, /*once=*/false))
            model_names[world.rank()].push_back(name);
          std::unique_ptr<Mesh> mesh;  // outlives the wrapper (declared first)
          std::unique_ptr<ParallelModel> w = wrapping.wrap(model, world, mesh);
          runs[world.rank()] = train_through_the_interface(world.world(), c, *w);
        },
        test_group());
    std::vector<std::vector<at::Tensor>> copied, visited, named;
    for (int r = 0; r < 4; ++r) {
      const FullModel& run = runs[r];
      copied.push_back(run.copied);
      visited.push_back(run.visited);
      std::vector<std::string> names;
      std::vector<at::Tensor> params_in_state;
      for (const auto& [name, t] : run.state) {
        names.push_back(name);
        if (params_in_state.size() < ref.params.size()) params_in_state.push_back(t.detach().cpu());
      }
      named.push_back(params_in_state);
      EXPECT_EQ(names, model_names[r]) << wrapping.name << " rank " << r
                                       << ": full_state_dict names the model's state as PyTorch's state_dict does";
    }
    test_support::expect_ranks_match(copied, ref.params, wrapping.name, "full_parameters");
    test_support::expect_ranks_close(visited, copied, 0, 0, wrapping.name, "visit_full_parameters beside them");
    test_support::expect_ranks_close(named, copied, 0, 0, wrapping.name, "full_state_dict's parameters beside them");
  }
}

// ParallelPolicy::buffers reaches the sharded units: pooled (the default), their all-gather and reduce-scatter buffers
// come from the wrapper's BufferPool and are reused from the second step on; not pooled, the pool holds nothing.
TEST(ParallelizePolicy, TheBufferPolicyDecidesWhetherTheUnitsBuffersComeFromThePool) {
  const TrainConfig c = test_support::config("mlp").steps(2).global_batch(8).seed(31);
  for (const bool pool : {true, false}) {
    std::vector<PoolStats> stats(2);
    run_world(
        2,
        [&](World& world) {
          Mesh mesh(world, 1, 2);
          ParallelPolicy policy;
          policy.buffers.pool = pool;
          auto dp = parallelize(make_model(c, at::kCPU), mesh, policy);
          test_support::train_steps(world.world(), c, dp->parameters(), at::kCPU, *dp);
          stats[world.rank()] = dp->facet<fsdp::FullyShardedModel>()->pool_stats();
        },
        test_group());
    for (int r = 0; r < 2; ++r) {
      const PoolStats& s = stats[r];
      std::cout << "buffers.pool " << pool << ", rank " << r << ": " << s.system_allocations
                << " blocks from the system, " << s.reuses << " reused, peak reserved " << s.peak_reserved_bytes
                << " bytes\n";
      if (pool) {
        EXPECT_GT(s.system_allocations, 0) << "rank " << r << ": the units' buffers should come from the pool";
        EXPECT_GT(s.reuses, 0) << "rank " << r << ": the second step should reuse the first step's blocks";
      } else {
        EXPECT_EQ(s.system_allocations + s.reuses + s.peak_reserved_bytes, 0)
            << "rank " << r << ": buffers.pool false, yet the pool was used";
      }
    }
  }
}

// ParallelPolicy::prefetch is optional: the sharded units get stage 05's schedule by default, none when it is empty.
TEST(ParallelizePolicy, PrefetchIsOnByDefaultAndOffWhenThePolicyHasNone) {
  const TrainConfig c = test_support::config("mlp").seed(41);
  run_world(
      2,
      [&](World& world) {
        Mesh mesh(world, 1, 2);
        auto ahead = parallelize(make_model(c, at::kCPU), mesh);
        EXPECT_NE(ahead->facet<fsdp::FullyShardedModel>()->schedule(), nullptr) << "prefetch by default";
        ParallelPolicy none;
        none.prefetch.reset();
        auto on_use = parallelize(make_model(c, at::kCPU), mesh, none);
        EXPECT_EQ(on_use->facet<fsdp::FullyShardedModel>()->schedule(), nullptr) << "no prefetch policy, no schedule";
      },
      test_group());
}

}  // namespace
}  // namespace shardlab
