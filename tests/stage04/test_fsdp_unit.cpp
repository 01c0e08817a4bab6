// Stage 04, tasks 2 and 3 — one unit: sharded at construction, gathered bit for bit by one all-gather, freed to 0
// bytes, and its gradients reduce-scattered into the mean of the ranks' rows.
#include "shardlab/fsdp/fsdp_unit.h"

#include "shardlab/common/flat_storage.h"
#include "shardlab/common/model.h"
#include "shardlab/common/thread_ranks.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <iostream>

namespace shardlab::fsdp {
namespace {

using test_support::test_group;

// Uneven shapes (FSDP2's test shapes): dim 0 of 7 and 3 leaves padding at 2, 3 and 4 ranks, and an empty shard.
struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    a = register_module("a", torch::nn::Linear(15, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

std::vector<std::pair<std::string, at::Tensor>> named(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

std::shared_ptr<GradientReducer> rs_hook(Communicator& comm) {
  return hook_reducer(comm_hooks::make_hook("reduce_scatter", comm));
}

class UnitWorlds : public ::testing::TestWithParam<int> {};

TEST_P(UnitWorlds, ShardsThenGathersEveryParameterBitForBitWithOneAllGather) {
  const int world = GetParam();
  run_ranks(
      world,
      [&](Communicator& comm) {
        TwoLayers m;
        init_parameters(m, 3);
        std::vector<at::Tensor> original;
        for (const auto& p : m.parameters()) original.push_back(p.detach().clone());
        MemoryMeter meter;
        FsdpUnit unit("two", named(m), comm, {}, rs_hook(comm), meter);
        const int r = comm.rank();
        // Sharded: this rank's real rows only, the registered tensors without storage.
        EXPECT_EQ(unit.state(), UnitState::kSharded);
        EXPECT_EQ(unit.gathered_bytes(), 0);
        int64_t padded_total = 0;
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const FsdpParam& fp = unit.params()[k];
          padded_total += fp.spec.padded_numel();
          EXPECT_EQ(fp.sharded.sizes(), c10::IntArrayRef(fp.spec.shard_sizes(r))) << fp.name;
          EXPECT_TRUE(at::equal(fp.sharded, original[k].narrow(0, fp.spec.first_row_of(r), fp.spec.rows_of(r))))
              << fp.name << " rank " << r;
          EXPECT_TRUE(fp.sharded.is_leaf() && fp.sharded.requires_grad()) << fp.name;
          EXPECT_EQ(storage_bytes(fp.param), 0) << fp.name << " must have no storage while sharded";
          EXPECT_TRUE(fp.param.is_same(m.named_parameters()[fp.name])) << "the registered tensor keeps its identity";
        }
        const size_t mark = comm.recorder().size();
        unit.begin_unshard();
        EXPECT_EQ(unit.state(), UnitState::kUnsharding);
        unit.finish_unshard();
        EXPECT_EQ(unit.state(), UnitState::kUnsharded);
        const auto records = comm.recorder().since(mark);
        ASSERT_EQ(records.size(), 1u) << "one all-gather per unshard";
        EXPECT_EQ(records[0].op, "all_gather");
        EXPECT_EQ(records[0].numel, padded_total) << "each rank sends its padded shards: Σ padded shard numel";
        double diff = 0;
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const at::Tensor& p = unit.params()[k].param;
          diff = std::max(diff, (p - original[k]).abs().max().item<double>());
          EXPECT_TRUE(at::equal(p, original[k])) << unit.params()[k].name;
        }
        EXPECT_EQ(unit.gathered_bytes(), unit.gathered_capacity_bytes());
        if (r == 0) std::cout << "world " << world << ": gathered max |param - original| = " << diff << "\n";
        unit.unshard();  // already unsharded: no collective
        EXPECT_EQ(comm.recorder().size(), mark + 1);
        unit.reshard();
        EXPECT_EQ(unit.state(), UnitState::kSharded);
        EXPECT_EQ(unit.gathered_bytes(), 0) << "reshard frees the gathered buffer";
        for (const auto& fp : unit.params()) EXPECT_EQ(storage_bytes(fp.param), 0) << fp.name;
        EXPECT_EQ(meter.stats().param_bytes, unit.sharded_bytes()) << "only the shards stay accounted";
        const int64_t scratch = comm.all_gather_scratch_bytes(at::kFloat, unit.sharded_bytes() / 4, c10::kCPU);
        EXPECT_EQ(meter.stats().peak_param_bytes,
                  unit.sharded_bytes() + unit.gathered_capacity_bytes() + world * unit.sharded_bytes() + scratch)
            << "peak = shards + gathered + the all-gather buffer and the Communicator's copy during the copy-out";
      },
      test_group());
}

TEST_P(UnitWorlds, ReduceGradientsLeavesTheMeanOfTheRanksRowsInTheShardedGradients) {
  const int world = GetParam();
  run_ranks(
      world,
      [&](Communicator& comm) {
        TwoLayers m;
        init_parameters(m, 4);
        MemoryMeter meter;
        FsdpUnit unit("two", named(m), comm, {}, rs_hook(comm), meter);
        unit.unshard();
        // Rank r's unsharded gradient of parameter k: (r + 1) * base_k, base_k = 1, 2, 3, ... (exact in float).
        std::vector<at::Tensor> base;
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const FsdpParam& fp = unit.params()[k];
          base.push_back(at::arange(1, fp.spec.numel() + 1, at::kFloat).view(fp.spec.sizes));
          fp.param.mutable_grad() = base.back() * static_cast<double>(comm.rank() + 1);
          unit.note_gradient(k);
        }
        const size_t mark = comm.recorder().size();
        std::vector<std::string> missing;
        Handle h = unit.reduce_gradients(&missing);
        for (const auto& fp : unit.params())
          EXPECT_FALSE(fp.param.grad().defined()) << fp.name << ": the unsharded gradient is freed at once";
        h.wait();
        EXPECT_TRUE(missing.empty());
        const auto records = comm.recorder().since(mark);
        ASSERT_EQ(records.size(), 1u) << "one reduce-scatter per unit";
        EXPECT_EQ(records[0].op, "reduce_scatter");
        int64_t padded_total = 0;
        for (const auto& fp : unit.params()) padded_total += fp.spec.padded_numel();
        EXPECT_EQ(records[0].numel, world * padded_total) << "S rows of Σ padded shard numel";
        const double mean_scale = (world + 1) / 2.0;  // mean of 1..world: a sum would give world * (world + 1) / 2
        double diff = 0;
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const FsdpParam& fp = unit.params()[k];
          const at::Tensor expected =
              base[k].narrow(0, fp.spec.first_row_of(comm.rank()), fp.spec.rows_of(comm.rank())) * mean_scale;
          ASSERT_TRUE(fp.sharded.grad().defined()) << fp.name;
          EXPECT_EQ(fp.sharded.grad().sizes(), fp.sharded.sizes()) << fp.name << ": no padding in the sharded gradient";
          diff = std::max(diff,
                          fp.sharded.grad().numel() ? (fp.sharded.grad() - expected).abs().max().item<double>() : 0.0);
          EXPECT_TRUE(at::equal(fp.sharded.grad(), expected)) << fp.name << " rank " << comm.rank();
        }
        if (comm.rank() == 0)
          std::cout << "world " << world << ": max |sharded grad - mean of ranks| = " << diff << "\n";
        // A second reduction adds into the sharded gradients (accumulation across steps without zero_grad).
        for (size_t k = 0; k < unit.params().size(); ++k)
          unit.params()[k].param.mutable_grad() = base[k] * static_cast<double>(comm.rank() + 1);
        unit.reduce_gradients(nullptr).wait();
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const FsdpParam& fp = unit.params()[k];
          const at::Tensor expected =
              base[k].narrow(0, fp.spec.first_row_of(comm.rank()), fp.spec.rows_of(comm.rank())) * (2 * mean_scale);
          EXPECT_TRUE(at::equal(fp.sharded.grad(), expected)) << fp.name << " accumulated";
        }
        unit.reshard();
        EXPECT_EQ(meter.stats().grad_bytes, [&] {
          int64_t b = 0;
          for (const auto& fp : unit.params()) b += fp.sharded.numel() * 4;
          return b;
        }()) << "after the reduction only the sharded gradients stay accounted";
      },
      test_group());
}

INSTANTIATE_TEST_SUITE_P(Stage04, UnitWorlds, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(FsdpUnit, MissingGradientsCountAsZeroAndAreNamed) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        TwoLayers m;
        init_parameters(m, 5);
        MemoryMeter meter;
        FsdpUnit unit("two", named(m), comm, {}, rs_hook(comm), meter);
        const FsdpParam& weight = unit.params()[0];
        weight.param.mutable_grad() = at::ones(weight.spec.sizes);
        std::vector<std::string> missing;
        unit.reduce_gradients(&missing).wait();
        EXPECT_EQ(missing, (std::vector<std::string>{"a.bias", "b.weight", "b.bias"}));
        EXPECT_TRUE(unit.params()[1].sharded.grad().eq(0).all().item<bool>()) << "a missing gradient is a zero";
        EXPECT_TRUE(weight.sharded.grad().eq(1).all().item<bool>());
      },
      test_group());
}

TEST(FsdpUnit, RejectsWhatItCannotShardNamingTheParameter) {
  run_ranks(
      1,
      [&](Communicator& comm) {
        MemoryMeter meter;
        FsdpUnit good("good", {{"w", at::ones({3, 2}).requires_grad_()}}, comm, {}, rs_hook(comm), meter);
        EXPECT_EQ(good.params().front().sharded.sizes(), (c10::IntArrayRef{3, 2})) << "one rank holds every row";
        auto expect_error = [&](std::vector<std::pair<std::string, at::Tensor>> params, const std::string& needle) {
          try {
            FsdpUnit unit("bad", params, comm, {}, rs_hook(comm), meter);
            ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
          }
        };
        expect_error({{"gain", at::ones({}).requires_grad_()}}, "'gain'");
        expect_error({{"gain", at::ones({}).requires_grad_()}}, "scalar");
        expect_error({{"wt", at::ones({4, 3}).t().requires_grad_()}}, "not contiguous");
        expect_error({{"w", at::ones({4}).requires_grad_()}, {"d", at::ones({4}, at::kDouble).requires_grad_()}},
                     "dtype");
        expect_error({}, "expected parameters");
      },
      test_group());
}

}  // namespace
}  // namespace shardlab::fsdp
