// Stage 04 — sharded construction (Note [Sharded construction]): FSDP built from a ModelBuilder shards each unit as
// the model registers it, so no rank holds the whole model; the values are one device's at every world size, nothing
// is broadcast, and a rank whose build fails stops every rank.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/reference.h"

#include "support/counting_allocator.h"
#include "support/eight_block_gpt.h"
#include "support/fsdp_case.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/param_name.h"
#include "support/temp_dir.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace shardlab::fsdp {
namespace {

using test_support::on_cpu;
using test_support::test_group;

// The collectives `records` holds, as "op numel" lines.
std::string ops_of(const std::vector<CollectiveRecord>& records) {
  std::ostringstream s;
  for (const auto& r : records) s << r.op << " " << r.numel << "; ";
  return s.str();
}

TEST(ShardedBuild, EveryShippedModelStartsFromOneDevicesValuesAtEveryWorldSizeWithNoBroadcast) {
  for (const std::string model : {"mlp", "tiny_gpt", "edge"}) {
    TrainConfig c = test_support::config(model).seed(21);
    const std::vector<at::Tensor> one_device = on_cpu(make_model(c, at::kCPU)->parameters());
    for (int world = 1; world <= 4; ++world) {
      SCOPED_TRACE(model + " at " + std::to_string(world) + " ranks");
      std::vector<std::vector<at::Tensor>> full(world);
      std::vector<std::vector<CollectiveRecord>> ran(world);
      run_ranks(
          world,
          [&](Communicator& comm) {
            const size_t before = comm.recorder().size();
            FullyShardedModel fsdp([&] { return make_model(c, at::kCPU); }, comm);
            ran[comm.rank()] = comm.recorder().since(before);
            full[comm.rank()] = on_cpu(fsdp.full_parameters());
          },
          test_group());
      for (int r = 0; r < world; ++r) {
        const double diff = max_abs_diff(full[r], one_device);
        EXPECT_EQ(diff, 0.0) << "rank " << r << ": max |param - one device's| = " << diff;
        // The build's outcome (lengths, then texts), then the structure's digests: all-gathers, no broadcast.
        std::cout << model << " w" << world << " rank " << r << " construction ran: " << ops_of(ran[r]) << "\n";
        if (world > 1) ASSERT_EQ(ran[r].size(), 3u) << ops_of(ran[r]);  // a group of one records nothing
        for (const auto& rec : ran[r]) EXPECT_EQ(rec.op, "all_gather") << ops_of(ran[r]);
      }
    }
  }
}

using Case = test_support::FsdpCase;

class ShardedBuildEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedBuildEquivalence, TrainsLikeOneDevice) {
  const Case& e = GetParam();
  TrainConfig c = test_support::config(e.model)
                      .optimizer_at_its_lr(e.optimizer)
                      .steps(3)
                      .global_batch(12)
                      .micro_batches(e.micro)
                      .seed(17);
  // SGD and the MLP's and edge model's AdamW are tight (Note [Comparing with one device]): kRtol 1e-5, kAtol 1e-6.
  test_support::expect_case_trains_like_one_device(e, c, at::kCPU, [&](Communicator& comm, const Options& o) {
    return FullyShardedModel([&] { return make_model(c, at::kCPU); }, comm, o);
  });
}

INSTANTIATE_TEST_SUITE_P(Stage04, ShardedBuildEquivalence,
                         ::testing::Values(Case{"tiny_gpt", "sgd", 2, 1, true}, Case{"tiny_gpt", "sgd", 3, 2, false},
                                           Case{"mlp", "adamw", 4, 1, true}, Case{"edge", "sgd", 3, 2, true}),
                         test_support::StreamedName());

// Bytes of `ts`.
int64_t bytes_of(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

TEST(ShardedBuild, NoRankHoldsMoreThanItsShardsOneUnitAndTheRootWhileBuilding) {
  // A tiny GPT of 8 blocks: each block is an eighth of the model; the root (embeddings, final norm) is small.
  const TrainConfig c = test_support::eight_block_gpt();
  const int world = 4;
  auto whole = make_model(c, at::kCPU);
  const int64_t model_bytes = bytes_of(trainable_parameters(*whole));  // the tie once
  int64_t unit_bytes = 0;
  for (const auto& unit : whole->units()) unit_bytes = std::max(unit_bytes, bytes_of(unit.module->parameters()));
  const int64_t root_bytes = model_bytes - static_cast<int64_t>(whole->units().size()) * unit_bytes;
  whole.reset();

  // Every CPU tensor of the process is counted; the ranks are threads, so the peak is all ranks' at once.
  test_support::CountingCpuAllocator counting;
  auto peak_of = [&](bool sharded) {
    test_support::CountingCpuAllocator::Install installed(counting);
    run_ranks(
        world,
        [&](Communicator& comm) {
          if (sharded) {
            FullyShardedModel fsdp([&] { return make_model(c, at::kCPU); }, comm);
          } else {
            FullyShardedModel fsdp(make_model(c, at::kCPU), comm);
          }
        },
        test_group());
    return counting.peak();
  };
  const int64_t built_whole = peak_of(false), built_sharded = peak_of(true);
  // Each rank: its shards (a quarter of the model, padding aside), plus the block being built, its copy of the rows
  // and the unit's gathered buffer (made and freed to the pool: what the steady state holds anyway), plus the root
  // built whole. The whole build holds the model on every rank.
  const int64_t bound = model_bytes + world * (2 * unit_bytes + unit_bytes / world + root_bytes) + (64 << 10);
  std::cout << "model " << model_bytes << " B, block " << unit_bytes << " B, root " << root_bytes << " B; peak over "
            << world << " ranks: built whole " << built_whole << " B, sharded " << built_sharded << " B (bound "
            << bound << " B)\n";
  EXPECT_GE(built_whole, world * model_bytes) << "the whole build holds the model on every rank";
  EXPECT_LE(built_sharded, bound) << "the sharded build held more than the shards, one unit and the root per rank";
}

TEST(ShardedBuild, AFullFileLoadsStraightIntoTheShardsHoldingOnlyEachRanksRows) {
  // One device's tiny GPT of 8 blocks saved as one safetensors file (as an exported or a Hugging Face file), loaded
  // by 4 ranks built sharded from another seed: each holds only its rows, never the whole model (counted: every CPU
  // tensor; the reader's own 16 MiB chunks for CRC-32s are not tensors).
  const TrainConfig c = test_support::eight_block_gpt();
  const int world = 4;
  const test_support::TempDir dir("sharded-load");
  const std::string file = dir / "model.safetensors";
  TrainConfig saved_config = c;
  saved_config.seed = c.seed + 5;
  auto saved = make_model(saved_config, at::kCPU);
  safetensors::write_file(file, named_state(*saved, StateParts::kParametersAndBuffers, /*once=*/true));
  const std::vector<at::Tensor> expected = on_cpu(saved->parameters());
  const int64_t model_bytes = bytes_of(trainable_parameters(*saved));  // the tie once
  saved.reset();

  test_support::CountingCpuAllocator counting;
  std::vector<std::vector<at::Tensor>> loaded(world);
  int64_t load_peak = 0;
  run_ranks(
      world,
      [&](Communicator& comm) {
        FullyShardedModel fsdp([&] { return make_model(c, at::kCPU); }, comm);
        std::optional<test_support::CountingCpuAllocator::Install> installed;  // one for the process: rank 0's
        if (comm.rank() == 0) installed.emplace(counting);
        comm.barrier();
        fsdp.load_checkpoint(file, nullptr);  // every rank's load, counted at once
        comm.barrier();
        if (comm.rank() == 0) {
          load_peak = counting.peak();
          installed.reset();
        }
        comm.barrier();
        loaded[comm.rank()] = on_cpu(fsdp.full_parameters());
      },
      test_group());
  // Each rank holds its rows of every tensor while the load is checked (all or nothing), then writes them into its
  // shards: about a quarter of the model per rank, twice at most; a rank that read every tensor whole would hold
  // the model.
  const int64_t bound = 2 * model_bytes + world * (64 << 10);
  std::cout << "model " << model_bytes << " B; allocated at once while " << world << " ranks loaded: " << load_peak
            << " B (bound " << bound << " B; whole tensors on every rank would be " << world * model_bytes << " B)\n";
  EXPECT_LE(load_peak, bound);
  for (int r = 0; r < world; ++r) {
    const double diff = max_abs_diff(loaded[r], expected);
    EXPECT_EQ(diff, 0.0) << "rank " << r << ": max |loaded - saved| = " << diff;
  }
}

struct UserNet : Model {
  UserNet() {
    Initializer init(3);
    block = register_unit("block", init(torch::nn::Linear(7, 5).ptr()));
    head = register_module("head", torch::nn::Linear(5, 2));
    init.fill(*head);
  }
  at::Tensor loss(const Batch& b) override { return head->forward(block(b.input)).pow(2).mean(); }
  UnitRef<torch::nn::LinearImpl> block;
  torch::nn::Linear head{nullptr};
};

TEST(ShardedBuild, ARankWhoseBuildFailsStopsEveryRankWithItsError) {
  const int world = 3;
  std::vector<std::string> errors(world);
  std::vector<std::vector<CollectiveRecord>> ran(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        const size_t before = comm.recorder().size();
        try {
          FullyShardedModel fsdp(
              [&]() -> std::shared_ptr<Model> {
                if (comm.rank() == 2) throw std::invalid_argument("rank 2's data file is missing");
                return std::make_shared<UserNet>();
              },
              comm);
        } catch (const std::exception& e) {
          errors[comm.rank()] = e.what();
        }
        ran[comm.rank()] = comm.recorder().since(before);
      },
      test_group());
  for (int r = 0; r < world; ++r) {
    std::cout << "rank " << r << ": " << errors[r] << "\n";
    EXPECT_NE(errors[r].find("rank 2's data file is missing"), std::string::npos) << errors[r];
    if (r != 2)
      EXPECT_NE(errors[r].find("building the model failed on rank 2, so no rank goes on"), std::string::npos)
          << errors[r];
    EXPECT_EQ(ran[r].size(), 2u) << "the outcome's two all-gathers, no structure check: " << ops_of(ran[r]);
  }
}

struct FrozenAfterRegistration : Model {
  FrozenAfterRegistration() {
    Initializer init(3);
    block = register_unit("block", init(torch::nn::Linear(7, 5).ptr()));
    block->weight.set_requires_grad(false);  // too late: the unit was sharded as trainable
  }
  at::Tensor loss(const Batch& b) override { return block(b.input).pow(2).mean(); }
  UnitRef<torch::nn::LinearImpl> block;
};

TEST(ShardedBuild, AUserModelTrainsLikeOneDeviceAndAModelBuiltBeforeIsRefused) {
  // The recipe for a user's own model: initialize each unit before registering it (UserNet).
  const int world = 2;
  {  // a unit changed after it was registered: a user error on every rank, naming the contract
    std::vector<std::string> errors(world);
    run_ranks(
        world,
        [&](Communicator& comm) {
          try {
            FullyShardedModel fsdp([] { return std::make_shared<FrozenAfterRegistration>(); }, comm);
          } catch (const std::invalid_argument& e) {
            errors[comm.rank()] = e.what();
          }
        },
        test_group());
    for (int r = 0; r < world; ++r)
      EXPECT_NE(errors[r].find("unit 'block' changed after it was registered"), std::string::npos) << errors[r];
  }
  {  // a model built before the builder ran: its unit was registered outside the scope, never sharded
    std::vector<std::string> errors(world);
    run_ranks(
        world,
        [&](Communicator& comm) {
          auto prebuilt = std::make_shared<UserNet>();
          try {
            FullyShardedModel fsdp([&] { return prebuilt; }, comm);
          } catch (const std::invalid_argument& e) {
            errors[comm.rank()] = e.what();
          }
        },
        test_group());
    for (int r = 0; r < world; ++r) {
      std::cout << "rank " << r << ": " << errors[r] << "\n";
      EXPECT_NE(errors[r].find("has 1 units, of which 0 were registered while it ran"), std::string::npos) << errors[r];
    }
  }
  auto data = at::randn({4, 7}, at::TensorOptions().dtype(at::kFloat));
  Batch all{data, at::zeros({4}, at::kLong)};
  auto one = std::make_shared<UserNet>();
  one->loss(all).backward();
  const std::vector<at::Tensor> expected = test_support::grad_copies(one->parameters());
  std::vector<std::vector<at::Tensor>> grads(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        FullyShardedModel fsdp([] { return std::make_shared<UserNet>(); }, comm);
        fsdp.loss(all.slice(2 * comm.rank(), 2)).backward();
        // Each shard's gradient is its rows of one device's; gather them by the unit's shard layout.
        for (const auto& unit : fsdp.units())
          for (const auto& p : unit->params()) grads[comm.rank()].push_back(p.sharded.grad().clone());
      },
      test_group());
  // Rank r holds rows [r * ceil(d0 / 2), ...) of each parameter (torch.chunk): block.weight 5 rows -> 3 + 2.
  const std::vector<std::string> names{"block.weight", "block.bias", "head.weight", "head.bias"};
  for (size_t k = 0; k < expected.size(); ++k) {
    const int64_t rows = expected[k].size(0), chunk = (rows + world - 1) / world;
    at::Tensor joined = at::cat({grads[0][k], grads[1][k]}, 0);
    const double diff = (joined - expected[k]).abs().max().item<double>();
    std::cout << names[k] << ": " << rows << " rows, chunks of " << chunk << ", max |grad - one device's| = " << diff
              << "\n";
    EXPECT_LE(diff, 1e-6) << names[k];
  }
}

}  // namespace
}  // namespace shardlab::fsdp
