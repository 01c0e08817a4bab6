// Stage 04, tasks 2 and 3 — one unit: sharded at construction, gathered bit for bit by one all-gather, freed to 0
// bytes, and its gradients reduce-scattered into the mean of the ranks' rows.
#include "shardlab/fsdp/fsdp_unit.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/model/model.h"
#include "shardlab/core/storage/buffer_pool.h"
#include "shardlab/core/storage/flat_storage.h"

#include "support/group.h"
#include "support/rank_zero_first.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <iostream>
#include <limits>

namespace shardlab::fsdp {
namespace {

using test_support::test_group;

// Uneven shapes (FSDP2's test shapes): dim 0 of 7 and 3 leaves padding at 2, 3 and 4 ranks, and an empty shard.
// Its parameters are initialized from `seed` (init_parameters).
struct TwoLayers : torch::nn::Module {
  explicit TwoLayers(uint64_t seed) {
    a = register_module("a", torch::nn::Linear(15, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
    init_parameters(*this, seed);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

// Detached copies of `m`'s parameters, in registration order: the values a unit must gather back.
std::vector<at::Tensor> values_of(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

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
        TwoLayers m(3);
        const std::vector<at::Tensor> original = values_of(m);
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
        EXPECT_EQ(meter.stats().peak_param_bytes,
                  unit.sharded_bytes() + unit.gathered_capacity_bytes() + world * unit.sharded_bytes())
            << "peak = shards + gathered + the all-gather buffer during the copy-out, as allocated (the "
               "Communicator's own copies are not the meter's)";
      },
      test_group());
}

// Task 2's split of the unshard: begin_unshard only issues the all-gather, into a buffer from the unit's BufferPool
// (new_buffer), and returns (stage 05 prefetches with it); the gathered buffer gets its bytes only at the copy-out,
// so a unit whose all-gather is in flight holds the all-gather buffer alone; finish_unshard drops that buffer
// again; and no write goes through a registered tensor (autograd's version counter does not move).
TEST_P(UnitWorlds, BeginUnshardOnlyIssuesAndTheGatheredBufferGetsItsBytesAtCopyOut) {
  const int world = GetParam();
  std::atomic<bool> rank0_issued{false};
  run_ranks(
      world,
      [&](Communicator& comm) {
        TwoLayers m(6);
        const std::vector<at::Tensor> original = values_of(m);
        BufferPool pool;
        MemoryMeter meter;
        FsdpUnit unit("two", named(m), comm, {}, rs_hook(comm), meter, &pool);
        std::vector<int64_t> versions;
        for (const auto& fp : unit.params()) versions.push_back(fp.param._version());
        const int64_t lent = pool.stats().in_use_bytes;  // what the pool lends the sharded unit (nothing)
        // Rank 0 begins first, the others once its begin_unshard has returned (or after 30 s). An all-gather cannot
        // complete before every rank has issued it: a begin_unshard that waits for it returns only after that.
        test_support::rank_zero_first(comm, rank0_issued,
                                      "rank 0's begin_unshard had not returned 30 s later, while rank " +
                                          std::to_string(comm.rank()) +
                                          " had not issued its all-gather yet: begin_unshard must only issue the "
                                          "all-gather; finish_unshard waits for it",
                                      [&] { unit.begin_unshard(); });
        ASSERT_EQ(unit.state(), UnitState::kUnsharding);
        const int64_t all_gather = world * unit.sharded_bytes();  // S blocks of the padded shards, f32
        EXPECT_EQ(unit.gathered_bytes(), 0)
            << "while the all-gather is in flight the gathered buffer has 0 bytes: it gets them at the copy-out "
               "(regrow_storage in finish_unshard), not when the all-gather is issued";
        EXPECT_EQ(unit.all_gather_bytes_held(), all_gather) << "the all-gather buffer: S blocks of the padded shards";
        EXPECT_EQ(pool.stats().in_use_bytes - lent, all_gather)
            << "expected the all-gather buffer (" << all_gather
            << " bytes) to come from the unit's BufferPool (new_buffer), and nothing else before the copy-out";
        unit.finish_unshard();
        EXPECT_EQ(unit.all_gather_bytes_held(), 0) << "after the copy-out finish_unshard drops the all-gather buffer";
        EXPECT_EQ(unit.gathered_bytes(), unit.gathered_capacity_bytes());
        EXPECT_EQ(pool.stats().in_use_bytes - lent, unit.gathered_capacity_bytes())
            << "unsharded, the unit holds its gathered buffer only (" << unit.gathered_capacity_bytes() << " bytes)";
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const FsdpParam& fp = unit.params()[k];
          EXPECT_TRUE(at::equal(fp.param, original[k])) << fp.name;
          EXPECT_EQ(fp.param._version(), versions[k])
              << fp.name << ": the unshard wrote through the registered tensor (autograd's version counter went from "
              << versions[k] << " to " << fp.param._version()
              << "); write the values through the gathered buffer (Note [Why the registered tensor never changes])";
        }
        unit.reshard();
        EXPECT_EQ(pool.stats().in_use_bytes, lent) << "resharded, the unit holds nothing of the pool";
      },
      test_group());
}

TEST_P(UnitWorlds, ReduceGradientsLeavesTheMeanOfTheRanksRowsInTheShardedGradients) {
  const int world = GetParam();
  run_ranks(
      world,
      [&](Communicator& comm) {
        TwoLayers m(4);
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
        TwoLayers m(5);
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

// What the optimizer steps is what the next all-gather sends: each sharded parameter is a slot of the sharded buffer,
// so an update in place (what an optimizer makes) reaches every rank's gathered parameter. And a gradient the
// registered tensor held before is dropped at construction (Hint 2: its shape and dtype no longer match the slot;
// kept, it would be added into the first step's gradient).
TEST(FsdpUnit, AnUpdateOfTheShardedParametersIsWhatTheNextAllGatherSends) {
  const int world = 3;  // 7 rows: [3, 3, 1], padding on rank 2
  run_ranks(
      world,
      [&](Communicator& comm) {
        TwoLayers m(8);
        std::vector<at::Tensor> original;
        for (auto& p : m.parameters()) {
          original.push_back(p.detach().clone());
          p.mutable_grad() = at::ones_like(p);  // a gradient from before the wrapping
        }
        MemoryMeter meter;
        FsdpUnit unit("two", named(m), comm, {}, rs_hook(comm), meter);
        for (const auto& fp : unit.params())
          EXPECT_FALSE(fp.param.grad().defined())
              << fp.name << ": the registered tensor still holds the gradient it had before sharding ("
              << c10::str(fp.param.grad().sizes()) << "); drop it before set_data (Hint 2)";
        {
          at::NoGradGuard no_grad;
          for (const auto& fp : unit.params()) fp.sharded.add_(100.0 * (comm.rank() + 1));  // as an optimizer step
        }
        unit.unshard();
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const FsdpParam& fp = unit.params()[k];
          at::Tensor expected = original[k].clone();
          for (int r = 0; r < world; ++r)
            expected.narrow(0, fp.spec.first_row_of(r), fp.spec.rows_of(r)).add_(100.0 * (r + 1));
          EXPECT_TRUE(at::equal(fp.param, expected))
              << "rank " << comm.rank() << ", " << fp.name
              << ": every rank stepped its sharded parameter in place, but the gathered parameter does not show it "
                 "(max |gathered - stepped| = "
              << (fp.param - expected).abs().max().item<double>()
              << "); the sharded parameter must be a slot of the sharded buffer the all-gather sends, not a copy";
        }
        unit.reshard();
      },
      test_group());
}

// Records the input of every reduction (this rank's S rows), then reduces as the default does.
class CapturingReducer final : public GradientReducer {
 public:
  explicit CapturingReducer(std::shared_ptr<GradientReducer> inner) : inner_(std::move(inner)) {}
  Handle operator()(const at::Tensor& input, const at::Tensor& output) override {
    inputs.push_back(input.clone());
    return (*inner_)(input, output);
  }
  int64_t scratch_bytes(c10::ScalarType dtype, int64_t numel, c10::Device device) const override {
    return inner_->scratch_bytes(dtype, numel, device);
  }
  std::string name() const override { return "capturing"; }
  std::vector<at::Tensor> inputs;

 private:
  std::shared_ptr<GradientReducer> inner_;
};

// Task 3's layout, seen by the reducer: row r holds rank r's chunk of each gradient, then zeros up to the padded
// chunk, and zeros for a missing gradient, whatever the buffer held before (here NaN: the pool hands out a block it
// had lent before). The padding is dropped after the reduction, so only the reducer sees it. After wait(), each
// sharded gradient is a tensor of its own, not a view of the reduce-scatter's output row.
TEST(FsdpUnit, TheReduceScatterInputIsPaddedWithZerosAndEachShardedGradientOwnsItsMemory) {
  const int world = 4;  // a: 7 rows [2, 2, 2, 1], b: 3 rows [1, 1, 1, 0]: padding on rank 3
  run_ranks(
      world,
      [&](Communicator& comm) {
        TwoLayers m(9);
        BufferPool pool;
        MemoryMeter meter;
        auto capture = std::make_shared<CapturingReducer>(rs_hook(comm));
        FsdpUnit unit("two", named(m), comm, {}, capture, meter, &pool);
        unit.unshard();
        int64_t row = 0;
        for (const auto& fp : unit.params()) row += fp.spec.padded_numel();
        {  // the next block of S rows the pool lends is full of NaN
          at::Tensor junk = pool.empty(world * row, at::kFloat);
          junk.fill_(std::numeric_limits<float>::quiet_NaN());
        }
        const std::string missing_name = "b.bias";
        for (size_t k = 0; k < unit.params().size(); ++k) {
          const FsdpParam& fp = unit.params()[k];
          if (fp.name == missing_name) continue;
          fp.param.mutable_grad() = at::full(fp.spec.sizes, comm.rank() + 1.0f);
          unit.note_gradient(k);
        }
        std::vector<std::string> missing;
        unit.reduce_gradients(&missing).wait();
        EXPECT_EQ(missing, std::vector<std::string>{missing_name});
        ASSERT_EQ(capture->inputs.size(), 1u);
        const at::Tensor rows = capture->inputs[0].view({world, row});
        for (int r = 0; r < world; ++r) {
          for (const auto& fp : unit.params()) {
            const at::Tensor chunk = rows[r].narrow(0, fp.grad_offset, fp.spec.padded_numel());
            const int64_t real = fp.name == missing_name ? 0 : fp.spec.rows_of(r) * fp.spec.row_numel;
            const at::Tensor pad = chunk.narrow(0, real, chunk.numel() - real);
            EXPECT_TRUE(pad.eq(0).all().item<bool>())
                << "rank " << comm.rank() << ", row " << r << " of the reduce-scatter input, " << fp.name << ": "
                << (fp.name == missing_name ? "a missing gradient counts as zeros" : "the padding after its real rows")
                << " (elements [" << fp.grad_offset + real << ", " << fp.grad_offset + fp.spec.padded_numel()
                << ")) must be zero; got " << pad;
          }
        }
        for (const auto& fp : unit.params()) {
          const at::Tensor& g = fp.sharded.grad();
          ASSERT_TRUE(g.defined()) << fp.name;
          const int64_t own = g.numel() * static_cast<int64_t>(g.element_size());
          EXPECT_TRUE(!g.is_view() && static_cast<int64_t>(g.storage().nbytes()) == own)
              << fp.name << ": the sharded gradient must be a tensor of its own (" << own
              << " bytes); it is a view of a storage of " << g.storage().nbytes()
              << " bytes (the reduce-scatter output row?)";
        }
        unit.reshard();
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
