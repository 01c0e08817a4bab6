// Stage 04, task 4 — FSDP's schedule: B+1 all-gathers in forward, B in backward and B+1 reduce-scatters per step,
// units freed between uses, reduce-scatters launched in reverse forward order and one at a time, and no_sync, which
// reduce-scatters only on the last micro-batch and stashes the gradients in the reduce dtype until then.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/storage/flat_storage.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/fsdp_case.h"
#include "support/group.h"
#include "support/mixed_precision.h"
#include "support/spaced_batch.h"
#include "support/train_config.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <iostream>
#include <string>

namespace shardlab::fsdp {
namespace {

using test_support::test_group;

// Records of one phase, split by op.
struct Phase {
  std::vector<CollectiveRecord> all_gathers, reduce_scatters, other;
};

Phase split(const std::vector<CollectiveRecord>& records) {
  Phase p;
  for (const auto& r : records) {
    if (r.op == "all_gather")
      p.all_gathers.push_back(r);
    else if (r.op == "reduce_scatter")
      p.reduce_scatters.push_back(r);
    else
      p.other.push_back(r);
  }
  return p;
}

class Structure : public ::testing::TestWithParam<bool> {};

TEST_P(Structure, CollectivesPerStepAndUnitStorageFollowTheSchedule) {
  const bool raf = GetParam();
  TrainConfig c = test_support::config("tiny_gpt").global_batch(4);
  const int world = 2, blocks = static_cast<int>(c.layers);
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        Options options;
        options.reshard_after_forward = raf;
        FullyShardedModel fsdp(model, comm, options);
        ASSERT_EQ(fsdp.units().size(), static_cast<size_t>(blocks + 1)) << "one unit per block, then the root";
        ASSERT_NE(fsdp.root(), nullptr);
        auto data = make_dataset(c.model, c.seed);
        for (int step = 0; step < 2; ++step) {
          Batch b = rank_slice(data->global_batch(step, c.global_batch), comm.rank(), world);
          const size_t start = comm.recorder().size();
          at::Tensor loss = fsdp.loss(b);
          const size_t after_forward = comm.recorder().size();
          // Between uses: units freed (raf) or kept (no raf); the root stays gathered for its backward.
          for (size_t u = 0; u + 1 < fsdp.units().size(); ++u)
            EXPECT_EQ(fsdp.units()[u]->gathered_bytes(), raf ? 0 : fsdp.units()[u]->gathered_capacity_bytes())
                << fsdp.units()[u]->name() << " after forward";
          EXPECT_EQ(fsdp.root()->gathered_bytes(), fsdp.root()->gathered_capacity_bytes()) << "root after forward";
          const int64_t held_after_forward = fsdp.memory().param_bytes;
          fsdp.record_memory_samples(true);
          const int64_t backward_start = now_ns();
          loss.backward();
          fsdp.record_memory_samples(false);
          Phase forward, backward;
          {
            const auto all = comm.recorder().since(start);
            forward = split({all.begin(), all.begin() + static_cast<long>(after_forward - start)});
            backward = split({all.begin() + static_cast<long>(after_forward - start), all.end()});
          }
          std::cout << (raf ? "raf" : "keep") << " step " << step << ": forward " << forward.all_gathers.size()
                    << " all-gathers, backward " << backward.all_gathers.size() << " all-gathers and "
                    << backward.reduce_scatters.size() << " reduce-scatters\n";
          ASSERT_EQ(forward.all_gathers.size(), static_cast<size_t>(blocks + 1)) << "B+1 all-gathers in forward";
          EXPECT_TRUE(forward.reduce_scatters.empty() && forward.other.empty()) << "nothing else in forward";
          // ASSERT: the checks below index by these counts.
          ASSERT_EQ(backward.all_gathers.size(), raf ? static_cast<size_t>(blocks) : 0u)
              << "backward gathers every block again (raf) or none (kept); the root is kept";
          ASSERT_EQ(backward.reduce_scatters.size(), static_cast<size_t>(blocks + 1)) << "B+1 reduce-scatters";
          EXPECT_TRUE(backward.other.empty()) << "no other collective";
          // Sizes: the forward gathers the root first, then block 0, 1, ...; each of the unit's padded shard numel.
          for (size_t i = 0; i < forward.all_gathers.size(); ++i) {
            const FsdpUnit& unit = i == 0 ? *fsdp.root() : *fsdp.units()[i - 1];
            EXPECT_EQ(forward.all_gathers[i].numel * static_cast<int64_t>(sizeof(float)), unit.sharded_bytes())
                << "all-gather " << i << " (" << unit.name() << ")";
          }
          // Backward gathers (raf) in reverse forward order, block B-1 first, each of the block's padded shards.
          for (size_t i = 0; i < backward.all_gathers.size(); ++i) {
            const FsdpUnit& unit = *fsdp.units()[blocks - 1 - i];
            EXPECT_EQ(backward.all_gathers[i].numel * static_cast<int64_t>(sizeof(float)), unit.sharded_bytes())
                << "backward all-gather " << i << " (" << unit.name() << ")";
          }
          // Reduce-scatters in reverse forward order: block B-1 first, the root last; S rows of padded numel.
          for (size_t i = 0; i < backward.reduce_scatters.size(); ++i) {
            const FsdpUnit& unit =
                i + 1 == backward.reduce_scatters.size() ? *fsdp.root() : *fsdp.units()[blocks - 1 - i];
            EXPECT_EQ(backward.reduce_scatters[i].numel * static_cast<int64_t>(sizeof(float)),
                      world * unit.sharded_bytes())
                << "reduce-scatter " << i << " (" << unit.name() << ")";
          }
          // Kept after forward, a block is still freed at its own backward, as soon as its gradients are complete:
          // the j-th block's bytes are gone before the next unit's reduce-scatter starts (same thread, same clock),
          // not at the end of backward.
          if (!raf) {
            const int64_t block_bytes = fsdp.units()[0]->gathered_capacity_bytes();
            for (int j = 1; j <= blocks; ++j) {
              int64_t freed_at = -1;
              for (const auto& m : fsdp.memory_samples()) {
                if (m.ns >= backward_start && m.param_bytes <= held_after_forward - j * block_bytes) {
                  freed_at = m.ns;
                  break;
                }
              }
              ASSERT_GE(freed_at, 0) << "block " << blocks - j << " never freed in backward";
              EXPECT_LE(freed_at, backward.reduce_scatters[j].start_ns)
                  << "block " << blocks - j << " was freed only after the reduce-scatter of the unit after it began";
            }
          }
          // After backward: every unit sharded, no unsharded parameter or gradient storage left.
          for (const auto& unit : fsdp.units()) {
            EXPECT_EQ(unit->state(), UnitState::kSharded) << unit->name() << " is " << to_string(unit->state());
            EXPECT_EQ(unit->gathered_bytes(), 0) << unit->name();
            for (const auto& fp : unit->params()) {
              EXPECT_EQ(storage_bytes(fp.param), 0) << fp.name;
              EXPECT_FALSE(fp.param.grad().defined()) << fp.name << " keeps an unsharded gradient";
              EXPECT_TRUE(fp.sharded.grad().defined()) << fp.name;
            }
          }
          for (const auto& p : fsdp.parameters()) p.mutable_grad().zero_();
        }
      },
      test_group());
}

INSTANTIATE_TEST_SUITE_P(Stage04, Structure, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "reshard_after_forward" : "keep_after_forward"; });

TEST(FullyShardedModel, NoSyncAccumulatesAndReduceScattersOnlyOnTheLastMicroBatch) {
  TrainConfig c = test_support::config("tiny_gpt").global_batch(12);
  test_support::fsdp_on_two_ranks(c, {}, [&](Communicator& comm, FullyShardedModel& fsdp, const Batch& batch) {
    auto micro = micro_batches(batch, 3);
    const size_t start = comm.recorder().size();
    for (int i = 0; i < 2; ++i) {
      auto scope = fsdp.no_sync();
      EXPECT_FALSE(fsdp.sync_enabled());
      fsdp.loss(micro[i]).backward();
    }
    const Phase accumulating = split(comm.recorder().since(start));
    EXPECT_TRUE(accumulating.reduce_scatters.empty()) << "no reduce-scatter inside no_sync";
    for (const auto& unit : fsdp.units())
      for (const auto& fp : unit->params()) {
        EXPECT_TRUE(fp.param.grad().defined()) << fp.name << ": the unsharded gradient accumulates";
        EXPECT_FALSE(fp.sharded.grad().defined()) << fp.name;
      }
    const size_t last = comm.recorder().size();
    fsdp.loss(micro[2]).backward();
    const Phase synced = split(comm.recorder().since(last));
    EXPECT_EQ(synced.reduce_scatters.size(), fsdp.units().size()) << "one reduce-scatter per unit, once";
    for (const auto& unit : fsdp.units())
      for (const auto& fp : unit->params()) EXPECT_FALSE(fp.param.grad().defined()) << fp.name;
  });
}

// Three units in a chain; the middle one has a parameter the loss reads only when `use_extra` is set. Without it the
// middle unit's gradients never all come: the end of backward settles it.
struct MaybeUsed : torch::nn::Module {
  MaybeUsed() : fc(register_module("fc", torch::nn::Linear(6, 6))) {
    extra = register_parameter("extra", at::zeros({6}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor y = fc->forward(x);
    return use_extra ? y + extra : y;
  }
  torch::nn::Linear fc;
  at::Tensor extra;
  bool use_extra = true;
};

struct Chain : Model {
  Chain() {
    first = register_unit("first", torch::nn::Linear(4, 6).ptr());
    middle = register_unit("middle", std::make_shared<MaybeUsed>());
    last = register_unit("last", torch::nn::Linear(6, 3).ptr());
    init_parameters(*this, 11);
  }
  at::Tensor loss(const Batch& b) override { return last(at::tanh(middle(at::tanh(first(b.input))))).pow(2).mean(); }
  UnitRef<torch::nn::LinearImpl> first;
  UnitRef<MaybeUsed> middle;
  UnitRef<torch::nn::LinearImpl> last;
};

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return "[" + out + "]";
}

// 'first' is complete before 'middle', whose 'extra' never gets a gradient; a rank that launched whatever is
// complete would send first's reduce-scatter where another rank (where 'extra' was used) sends middle's.
TEST(FullyShardedModel, ReduceScattersLaunchInReverseForwardOrderEvenWhenAUnitIsSettledAtTheEnd) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Chain>();
        model->middle->use_extra = false;
        Options options;
        options.allow_unused_parameters = true;
        FullyShardedModel fsdp(model, comm, options);
        ASSERT_EQ(fsdp.units().size(), 3u) << "three units, no root";
        std::vector<std::string> launched;
        fsdp.set_observer([&](const UnitEvent& e) {
          if (e.kind == UnitEventKind::kReduceLaunched) launched.push_back(fsdp.units()[e.unit]->name());
        });
        const size_t mark = comm.recorder().size();
        fsdp.loss(rank_slice(test_support::spaced_batch(4, 4), comm.rank(), comm.size())).backward();
        fsdp.set_observer({});
        const std::vector<std::string> expected{"last", "middle", "first"};
        EXPECT_EQ(launched, expected)
            << "rank " << comm.rank() << ": reduce-scatters are launched in reverse forward order " << joined(expected)
            << ", a complete unit waiting for the units before it (Note [Reduce-scatters in one "
            << "order on every rank]); got " << joined(launched);
        EXPECT_EQ(split(comm.recorder().since(mark)).reduce_scatters.size(), 3u) << "one reduce-scatter per unit";
      },
      test_group());
}

TEST(FullyShardedModel, AtMostOneReduceScatterIsInFlight) {
  TrainConfig c = test_support::config("tiny_gpt").global_batch(4);
  test_support::fsdp_on_two_ranks(c, {}, [&](Communicator& comm, FullyShardedModel& fsdp, const Batch& batch) {
    std::vector<std::string> in_flight;  // units whose reduction was launched and has not landed
    size_t launches = 0;
    fsdp.set_observer([&](const UnitEvent& e) {
      const std::string& name = fsdp.units()[e.unit]->name();
      if (e.kind == UnitEventKind::kReduceLaunched) {
        EXPECT_TRUE(in_flight.empty()) << "rank " << comm.rank() << ": '" << name
                                       << "' launched its reduce-scatter while " << joined(in_flight)
                                       << " still in flight (launched, not waited for); wait for the "
                                          "previous one first (Note [One reduce-scatter in flight])";
        ++launches;
      }
      if (e.kind == UnitEventKind::kReduceLanded)
        in_flight.erase(std::remove(in_flight.begin(), in_flight.end(), name), in_flight.end());
      if (e.kind == UnitEventKind::kReduceLaunched) in_flight.push_back(name);
    });
    fsdp.loss(batch).backward();
    fsdp.set_observer({});
    EXPECT_EQ(launches, fsdp.units().size());
    EXPECT_TRUE(in_flight.empty()) << "every reduction waited for by the end of backward: " << joined(in_flight);
  });
}

// Inside no_sync with a reduce dtype wider than the param dtype, a unit's gradients move into reduce-dtype
// accumulators (stash_gradients) once the unit is done, and those of a unit whose gradients never all came at the
// end of backward: micro-batches then add up in float, not in bfloat16.
TEST(FullyShardedModel, InsideNoSyncEveryUnitsGradientsAreStashedInTheReduceDtype) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Chain>();
        model->middle->use_extra = false;
        Options options = test_support::bf16_compute_f32_reduce();
        options.allow_unused_parameters = true;
        FullyShardedModel fsdp(model, comm, options);
        const Batch batch = rank_slice(test_support::spaced_batch(4, 4), comm.rank(), comm.size());
        {
          auto scope = fsdp.no_sync();
          fsdp.loss(batch).backward();
        }
        for (const auto& unit : fsdp.units())
          for (const auto& fp : unit->params())
            EXPECT_FALSE(fp.param.grad().defined())
                << "rank " << comm.rank() << ", " << fp.name << ": inside no_sync (param dtype bfloat16, reduce dtype "
                << "float) its unsharded gradient is still a " << c10::toString(fp.param.grad().scalar_type())
                << " .grad(); expected it moved into a float accumulator (stash_gradients) "
                << (unit->name() == "middle" ? "at the end of backward ('extra' got no gradient)"
                                             : "when its unit's gradients were complete");
        fsdp.loss(batch).backward();  // the synchronized micro-batch reduces what was stashed
        for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
      },
      test_group());
}

}  // namespace
}  // namespace shardlab::fsdp
