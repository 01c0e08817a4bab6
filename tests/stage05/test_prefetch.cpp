// Stage 05 — prefetch: the backward order (task 1), the targets (task 2), the schedule with its limit (task 3), and
// what the whole must keep: the same collectives, the same bits, the next all-gather issued before this unit's compute
// ends. Ranks are threads on real Gloo groups.
#include "shardlab/prefetch/prefetch.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "stage05/prefetch_support.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/param_name.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <set>

namespace shardlab::prefetch {
namespace {

using fsdp::FullyShardedModel;
using fsdp::SchedulePoint;
using fsdp::UnitEventKind;
using fsdp::UnitState;
using namespace test_support;  // tests/support: the rank loops, builders and checks
using Seq = std::vector<std::string>;

TrainConfig gpt() {
  TrainConfig c = test_support::config("tiny_gpt").layers(4).global_batch(4);
  return c;
}

Batch gpt_batch(const TrainConfig& c, int step, const Communicator& comm) {
  auto data = make_dataset(c.model, c.seed);
  return rank_slice(data->global_batch(step, c.global_batch), comm.rank(), comm.size());
}

// ---- Task 1: the backward order ----------------------------------------------------------------------------

// A schedule that only writes down where backward met the units, and what backward_order said then (task 1 alone:
// it prefetches nothing).
class Spy : public fsdp::UnshardSchedule {
 public:
  void at(SchedulePoint point, size_t u, FullyShardedModel& f) override {
    if (point != SchedulePoint::kPreBackward) return;
    pre_backward.push_back(u);
    orders_seen.push_back(backward_order(f));
  }
  std::vector<size_t> pre_backward;
  std::vector<std::vector<size_t>> orders_seen;
};

TEST(PrefetchOrders, BackwardOrderIsTheOrderThePreBackwardHooksFireInRootFirst) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        FullyShardedModel fsdp(std::make_shared<test_support::Chain>(std::vector<size_t>{2, 0, 3, 1}), comm);
        auto spy = std::make_shared<Spy>();
        fsdp.set_schedule(spy);
        at::Tensor loss = fsdp.loss(chain_batch(0, comm));
        const size_t root = fsdp.root_index();
        const std::vector<size_t> expected{root, 1, 3, 0, 2};
        EXPECT_EQ(backward_order(fsdp), expected) << "got " << joined(names_of(fsdp, backward_order(fsdp)));
        loss.backward();
        EXPECT_EQ(spy->pre_backward, expected)
            << "the pre-backward hooks fired in " << joined(names_of(fsdp, spy->pre_backward));
        for (const auto& seen : spy->orders_seen) EXPECT_EQ(seen, expected) << "the order is stable in backward";
      },
      test_group());
}

// A frozen block on the raw input makes an output that needs no gradient: no pre-backward hook, never met in
// backward. The backward order leaves it out, and backward meets the others in that order.
TEST(PrefetchOrders, AUnitWhoseOutputNeedsNoGradientIsNotInTheBackwardOrder) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<test_support::Chain>(std::vector<size_t>{0, 1, 2, 3}, /*dim=*/16);
        model->set_run_order({0, 1, 3});
        model->set_first_on_input(2);
        for (auto& item : model->named_parameters())
          if (item.key().rfind("block2.", 0) == 0) item.value().requires_grad_(false);
        FullyShardedModel fsdp(model, comm);
        auto spy = std::make_shared<Spy>();
        fsdp.set_schedule(spy);
        at::Tensor loss = fsdp.loss(chain_batch(0, comm));
        const size_t root = fsdp.root_index();
        ASSERT_FALSE(fsdp.awaits_backward(2)) << "block2's output needs no gradient";
        const std::vector<size_t> expected{root, 3, 1, 0};
        EXPECT_EQ(backward_order(fsdp), expected) << "got " << joined(names_of(fsdp, backward_order(fsdp)));
        loss.backward();
        EXPECT_EQ(spy->pre_backward, expected)
            << "backward met the units in " << joined(names_of(fsdp, spy->pre_backward));
      },
      test_group());
}

// ---- Task 2: the targets ------------------------------------------------------------------------------------

TEST(PrefetchTargets, NextDepthUnitsOfThePointsOrderOrTheUnitsOwnList) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        FullyShardedModel fsdp(std::make_shared<test_support::Chain>(std::vector<size_t>{0, 1, 2, 3}), comm);
        const size_t root = fsdp.root_index();
        using V = std::vector<size_t>;
        PrefetchPolicy two;
        two.forward_depth = 2;
        two.backward_depth = 3;
        two.forward_lists["block1"] = {"block3", "root"};
        two.backward_lists["root"] = {"block0"};
        two.forward_lists["block0"] = {};  // a list that names nothing: block0 prefetches nothing (not its depth)
        PrefetchSchedule one(fsdp, PrefetchPolicy{}), deep(fsdp, two);
        EXPECT_EQ(one.targets(SchedulePoint::kPreForward, root, fsdp), V{0}) << "root: the first block";
        EXPECT_EQ(one.targets(SchedulePoint::kPreForward, 2, fsdp), V{3});
        EXPECT_EQ(one.targets(SchedulePoint::kPreForward, 3, fsdp), V{}) << "the last unit: nothing after it";
        EXPECT_EQ(one.targets(SchedulePoint::kPostForward, 0, fsdp), V{}) << "post-forward prefetches nothing";
        EXPECT_EQ(deep.targets(SchedulePoint::kPreForward, root, fsdp), (V{0, 1}));
        EXPECT_EQ(deep.targets(SchedulePoint::kPreForward, 2, fsdp), V{3}) << "depth 2, but only one unit is left";
        EXPECT_EQ(deep.targets(SchedulePoint::kPreForward, 1, fsdp), (V{3, root})) << "block1's own list, in order";
        EXPECT_EQ(deep.targets(SchedulePoint::kPreForward, 0, fsdp), V{}) << "block0's own list is empty";
        at::Tensor loss = fsdp.loss(chain_batch(0, comm));
        EXPECT_EQ(one.targets(SchedulePoint::kPreBackward, root, fsdp), V{3}) << "backward: root first, then block3";
        EXPECT_EQ(one.targets(SchedulePoint::kPreBackward, 1, fsdp), V{0});
        EXPECT_EQ(one.targets(SchedulePoint::kPreBackward, 0, fsdp), V{}) << "block0's backward is the last";
        EXPECT_EQ(deep.targets(SchedulePoint::kPreBackward, 3, fsdp), (V{2, 1, 0}));
        EXPECT_EQ(deep.targets(SchedulePoint::kPreBackward, root, fsdp), V{0}) << "the root's own backward list";
        loss.backward();
      },
      test_group());
}

// ---- Task 3: the schedule -----------------------------------------------------------------------------------

// The frozen block of the test above: depth 1, and explicit lists that name it, gather in backward exactly what
// stage 04 gathers, one all-gather per block met, and never the frozen one.
TEST(PrefetchFrozen, BackwardNeverPrefetchesAUnitItWillNotMeet) {
  PrefetchPolicy listing;  // explicit backward lists, one of which names the frozen block
  listing.forward_depth = 0;
  listing.backward_depth = 0;
  listing.max_in_flight = 2;  // room for block2 beside block3: only awaits_backward keeps it out
  listing.backward_lists["root"] = {"block3", "block2"};
  listing.backward_lists["block3"] = {"block1"};
  listing.backward_lists["block1"] = {"block0"};
  for (const auto& [name, policy] :
       std::vector<std::pair<std::string, PrefetchPolicy>>{{"depth 1", PrefetchPolicy{}}, {"lists", listing}}) {
    run_ranks(
        2,
        [&, &name = name, &policy = policy](Communicator& comm) {
          auto model = std::make_shared<test_support::Chain>(std::vector<size_t>{0, 1, 2, 3}, /*dim=*/16);
          model->set_run_order({0, 1, 3});
          model->set_first_on_input(2);
          int frozen = 0;
          for (auto& item : model->named_parameters())
            if (item.key().rfind("block2.", 0) == 0) {
              item.value().requires_grad_(false);
              ++frozen;
            }
          ASSERT_EQ(frozen, 2) << "block2's weight and bias";
          FullyShardedModel fsdp(model, comm);
          auto schedule = enable_prefetch(fsdp, policy);
          UnitLog log(fsdp);
          at::Tensor loss = fsdp.loss(chain_batch(0, comm));
          log.take();
          const size_t root = fsdp.root_index();
          EXPECT_FALSE(fsdp.awaits_backward(2)) << "block2's output needs no gradient";
          EXPECT_EQ(backward_order(fsdp), (std::vector<size_t>{root, 3, 1, 0}))
              << "got " << joined(names_of(fsdp, backward_order(fsdp)));
          const size_t mark = comm.recorder().size();
          loss.backward();
          const Seq backward = log.take();
          if (comm.rank() == 0) std::cout << name << ", backward: " << joined(backward) << "\n";
          EXPECT_EQ(std::count(backward.begin(), backward.end(), "U block2"), 0)
              << name << ": block2 gathered in backward: " << joined(backward);
          int gathers = 0;
          for (const auto& r : comm.recorder().since(mark)) gathers += r.op == "all_gather" ? 1 : 0;
          EXPECT_EQ(gathers, 3) << name << ": one all-gather per block met in backward (block3, block1, block0)";
          EXPECT_GE(schedule->issued(), 3u) << name << ": block3, block1 and block0 were prefetched";
        },
        test_group());
  }
}

struct OrderCase {
  std::string name;
  PrefetchPolicy policy;
  bool root_raf;
  Seq forward, backward;
};

std::ostream& operator<<(std::ostream& os, const OrderCase& c) { return os << c.name; }

PrefetchPolicy depths(int forward, int backward, int limit = 0) {
  PrefetchPolicy p;
  p.forward_depth = forward;
  p.backward_depth = backward;
  p.max_in_flight = limit;
  return p;
}

PrefetchPolicy listed() {
  PrefetchPolicy p = depths(0, 0);
  p.backward_lists["root"] = {"block3", "block2"};
  p.forward_lists["block1"] = {"block3"};
  return p;
}

class PrefetchEvents : public ::testing::TestWithParam<OrderCase> {};

TEST_P(PrefetchEvents, UnshardsAndReshardsComeInExactlyThisOrder) {
  const OrderCase& e = GetParam();
  const TrainConfig c = gpt();
  run_ranks(
      2,
      [&](Communicator& comm) {
        fsdp::Options options;
        options.root_reshard_after_forward = e.root_raf;
        FullyShardedModel fsdp(make_model(c, at::kCPU), comm, options);
        enable_prefetch(fsdp, e.policy);
        UnitLog log(fsdp);
        for (int step = 0; step < 2; ++step) {  // the second step predicts from the first's order
          at::Tensor loss = fsdp.loss(gpt_batch(c, step, comm));
          const Seq forward = log.take();
          loss.backward();
          const Seq backward = log.take();
          if (comm.rank() == 0 && step == 1)
            std::cout << e.name << "\n  forward:  " << joined(forward) << "\n  backward: " << joined(backward) << "\n";
          EXPECT_EQ(forward, e.forward) << "step " << step << " forward was: " << joined(forward);
          EXPECT_EQ(backward, e.backward) << "step " << step << " backward was: " << joined(backward);
          for (const auto& p : fsdp.parameters()) p.mutable_grad().reset();
        }
      },
      test_group());
}

INSTANTIATE_TEST_SUITE_P(
    Stage05, PrefetchEvents,
    ::testing::Values(
        OrderCase{
            "no_prefetch",
            depths(0, 0),
            false,
            {"U root", "U block0", "R block0", "U block1", "R block1", "U block2", "R block2", "U block3", "R block3"},
            {"U block3", "R block3", "U block2", "R block2", "U block1", "R block1", "U block0", "R block0", "R root"}},
        OrderCase{
            "depth1",
            PrefetchPolicy{},
            false,
            {"U root", "U block0", "U block1", "R block0", "U block2", "R block1", "U block3", "R block2", "R block3"},
            {"U block3", "U block2", "R block3", "U block1", "R block2", "U block0", "R block1", "R block0", "R root"}},
        OrderCase{"depth1_root_raf",
                  PrefetchPolicy{},
                  true,
                  {"U root", "U block0", "U block1", "R block0", "U block2", "R block1", "U block3", "R block2",
                   "R block3", "R root"},
                  {"U root", "U block3", "U block2", "R block3", "U block1", "R block2", "U block0", "R block1",
                   "R block0", "R root"}},
        OrderCase{
            "depth2",
            depths(2, 2),
            false,
            {"U root", "U block0", "U block1", "U block2", "R block0", "U block3", "R block1", "R block2", "R block3"},
            {"U block3", "U block2", "U block1", "R block3", "U block0", "R block2", "R block1", "R block0", "R root"}},
        OrderCase{
            "depth2_limit1",
            depths(2, 2, 1),
            false,
            {"U root", "U block0", "U block1", "R block0", "U block2", "R block1", "U block3", "R block2", "R block3"},
            {"U block3", "U block2", "R block3", "U block1", "R block2", "U block0", "R block1", "R block0", "R root"}},
        OrderCase{
            "lists",
            listed(),
            false,
            {"U root", "U block0", "R block0", "U block1", "U block3", "R block1", "U block2", "R block2", "R block3"},
            {"U block3", "U block2", "R block3", "R block2", "U block1", "R block1", "U block0", "R block0",
             "R root"}}),
    [](const ::testing::TestParamInfo<OrderCase>& info) { return info.param.name; });

// The limit, counted from the units' storage at every event; the collectives, their count, sizes and order, the
// same with prefetch as without, and the same on every rank.
class PrefetchLimit : public ::testing::TestWithParam<int> {};

TEST_P(PrefetchLimit, HoldsAtEveryEventWithTheSameCollectivesOnEveryRank) {
  const int limit = GetParam();
  const TrainConfig c = gpt();
  const int world = 2;
  std::vector<std::vector<std::string>> records(world);
  std::vector<std::vector<std::string>> baseline(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        for (bool prefetch : {false, true}) {
          FullyShardedModel fsdp(make_model(c, at::kCPU), comm);
          std::shared_ptr<PrefetchSchedule> schedule;
          if (prefetch) schedule = enable_prefetch(fsdp, depths(3, 3, limit));  // asks for more than it may hold
          UnitLog log(fsdp);
          int most_ahead = 0, most_in_flight = 0;
          log.on_event = [&](const fsdp::UnitEvent&) {
            int in_flight = 0;
            for (const auto& unit : fsdp.units()) in_flight += unit->all_gather_bytes_held() > 0 ? 1 : 0;
            most_in_flight = std::max(most_in_flight, in_flight);
            if (schedule) most_ahead = std::max(most_ahead, static_cast<int>(schedule->ahead().size()));
          };
          const size_t mark = comm.recorder().size();
          fsdp.reset_memory_peaks();
          for (int step = 0; step < 2; ++step) {
            fsdp.loss(gpt_batch(c, step, comm)).backward();
            for (const auto& p : fsdp.parameters()) p.mutable_grad().reset();
          }
          auto& out = prefetch ? records[comm.rank()] : baseline[comm.rank()];
          for (const auto& r : comm.recorder().since(mark)) out.push_back(r.op + " " + std::to_string(r.numel));
          if (comm.rank() == 0)
            std::cout << (prefetch ? "prefetch" : "none") << " limit " << limit << ": at most " << most_ahead
                      << " ahead, " << most_in_flight << " all-gather buffers held at once; peak parameter bytes "
                      << fsdp.memory().peak_param_bytes << ", theory " << fsdp.memory_theory().peak_param_bytes << "\n";
          if (prefetch) {
            EXPECT_LE(most_ahead, limit) << "more units ahead than the limit";
            EXPECT_GE(most_ahead, limit) << "depth 3 asks for more than the limit: the limit must be reached";
            // A unit's own unshard may add one buffer to those ahead (the limit skipped its prefetch).
            EXPECT_LE(most_in_flight, limit + 1) << "all-gather buffers held at once";
            EXPECT_GT(schedule->skipped_for_limit(), 0u);
            EXPECT_EQ(fsdp.memory_theory().ahead, limit);
          } else {
            EXPECT_EQ(most_in_flight, 1) << "without prefetch one all-gather at a time";
          }
          EXPECT_LE(fsdp.memory().peak_param_bytes, fsdp.memory_theory().peak_param_bytes)
              << "the measured peak is within the theory that counts what is ahead";
        }
      },
      test_group());
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(records[r], records[0]) << "rank " << r << " issued other collectives than rank 0";
    std::multiset<std::string> with(records[r].begin(), records[r].end());
    std::multiset<std::string> without(baseline[r].begin(), baseline[r].end());
    EXPECT_EQ(with, without) << "prefetch changes when collectives are issued, never which: " << records[r].size()
                             << " with, " << baseline[r].size() << " without";
  }
}

INSTANTIATE_TEST_SUITE_P(Stage05, PrefetchLimit, ::testing::Values(1, 2));

// The counters count what happened: a target that is a no-op (already in flight) is never counted as skipped for
// the limit, even when the limit is reached; every target past the limit is. Six blocks, limit 3, explicit forward
// lists (a list may be as long as the limit). Root: {block1, block2, block3}: three issued, the limit reached.
// block0 (gathered by its own pre-forward): {block4, block1, block5}: block4 skipped, block1 in flight (a no-op),
// block5 skipped. A schedule that checks the limit before the no-op counts 3.
TEST(PrefetchCounters, ANoOpIsNeverSkippedForTheLimitAndEveryTargetPastTheLimitIs) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<test_support::Chain>(std::vector<size_t>{0, 1, 2, 3, 4, 5});
        FullyShardedModel fsdp(model, comm);
        PrefetchPolicy policy = depths(0, 0, 3);
        policy.forward_lists["root"] = {"block1", "block2", "block3"};
        policy.forward_lists["block0"] = {"block4", "block1", "block5"};
        auto schedule = enable_prefetch(fsdp, policy);
        fsdp.loss(chain_batch(0, comm)).backward();
        EXPECT_EQ(schedule->issued(), 3u) << "block1, block2, block3";
        EXPECT_EQ(schedule->skipped_for_limit(), 2u) << "block4 and block5 at block0; block1, in flight, is a no-op";
        EXPECT_EQ(schedule->cancelled(), 0u) << "every prefetched block ran";
      },
      test_group());
}

// The expected order is the last forward's; when the model then skips a block, the prefetch at the block before it
// was for nothing. The end of the forward cancels it: its buffer is freed there, and it no longer holds the one
// place under the limit, so backward still prefetches. Without the cancel, block2 stays in flight until the next
// loss() and every backward prefetch of this step is skipped for the limit.
TEST(PrefetchMispredicted, AUnitTheForwardSkippedIsCancelledAtItsEndAndBackwardStillPrefetches) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<test_support::Chain>(std::vector<size_t>{0, 1, 2, 3});
        fsdp::Options options;
        options.allow_unused_parameters = true;  // block2 gets no gradient in the second step
        FullyShardedModel fsdp(model, comm, options);
        auto schedule = enable_prefetch(fsdp, PrefetchPolicy{});  // depth 1, limit 1
        UnitLog log(fsdp);
        fsdp.loss(chain_batch(0, comm)).backward();
        log.take();
        model->set_run_order({0, 1, 3});
        at::Tensor loss = fsdp.loss(chain_batch(1, comm));
        const Seq forward = log.take();
        EXPECT_TRUE(schedule->ahead().empty())
            << "still ahead after the forward: " << joined(names_of(fsdp, schedule->ahead()));
        EXPECT_EQ(fsdp.units()[2]->state(), UnitState::kSharded) << "block2's all-gather buffer is freed";
        EXPECT_EQ(fsdp.units()[2]->all_gather_bytes_held(), 0);
        loss.backward();
        const Seq backward = log.take();
        if (comm.rank() == 0)
          std::cout << "forward:  " << joined(forward) << "\nbackward: " << joined(backward) << "\n";
        EXPECT_EQ(forward, (Seq{"U root", "U block0", "U block1", "R block0", "U block2", "R block1", "U block3",
                                "R block3", "R block2"}))
            << "block2 prefetched by block1 (the last order), cancelled at the end; was: " << joined(forward);
        EXPECT_EQ(backward, (Seq{"U block3", "U block1", "R block3", "U block0", "R block1", "R block0", "R root"}))
            << "each block's all-gather issued by the unit before it in backward; was: " << joined(backward);
        EXPECT_EQ(schedule->cancelled(), 1u);
        EXPECT_EQ(fsdp.memory().param_bytes, fsdp.memory_theory().sharded_param_bytes)
            << "after the step only the shards are held";
        // The mispredicted step held block2's all-gather buffer beside block3: one buffer above the steady-state
        // theory at most. The next step expects the new order: nothing cancelled, and within the theory.
        const int64_t buffer = fsdp.units()[2]->all_gather_bytes();
        EXPECT_LE(fsdp.memory().peak_param_bytes, fsdp.memory_theory().peak_param_bytes + buffer);
        fsdp.reset_memory_peaks();
        for (const auto& p : fsdp.parameters()) p.mutable_grad().reset();
        fsdp.loss(chain_batch(2, comm)).backward();
        if (comm.rank() == 0)
          std::cout << "the next step: peak " << fsdp.memory().peak_param_bytes << " bytes, theory "
                    << fsdp.memory_theory().peak_param_bytes << "\n";
        EXPECT_EQ(schedule->cancelled(), 1u) << "the next forward was predicted";
        EXPECT_LE(fsdp.memory().peak_param_bytes, fsdp.memory_theory().peak_param_bytes);
      },
      test_group());
}

// ---- The whole: the same bits, and the overlap as an order of events -----------------------------------------

struct BitCase {
  bool raf;
  int micro;
  bool mixed;
};

std::ostream& operator<<(std::ostream& os, const BitCase& e) {
  return os << (e.raf ? "raf" : "keep") << "_m" << e.micro << (e.mixed ? "_bf16" : "_f32");
}

class PrefetchBits : public ::testing::TestWithParam<BitCase> {};

TEST_P(PrefetchBits, ParametersAfterTrainingAreBitIdenticalWithAndWithoutPrefetch) {
  const BitCase& e = GetParam();
  TrainConfig c = gpt();
  c.steps = 3;
  c.global_batch = 8;
  c.micro_batches = e.micro;
  c.optimizer = "sgd";  // momentum: a wrong bit in step 1 still shows in step 3
  c.lr = 0.05;
  const int world = 2;
  const ReferenceResult ref = train_reference(c);
  std::map<int, std::vector<std::vector<at::Tensor>>> finals;  // depth -> per rank
  for (int depth : {-1, 0, 1, 2}) finals[depth].resize(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        for (int depth : {-1, 0, 1, 2}) {  // -1: no schedule at all (stage 04)
          fsdp::Options options;
          options.reshard_after_forward = e.raf;
          if (e.mixed) options.mixed_precision.param_dtype = at::kBFloat16;
          auto model = make_model(c, at::kCPU);
          FullyShardedModel fsdp(model, comm, options);
          if (depth >= 0) enable_prefetch(fsdp, depths(depth, depth));
          test_support::train_steps(comm, c, fsdp.parameters(), at::kCPU, fsdp);
          for (const auto& p : fsdp.full_parameters()) finals[depth][comm.rank()].push_back(p.detach().clone());
        }
      },
      test_group());
  for (int r = 0; r < world; ++r) {
    for (int depth : {0, 1, 2}) {
      const double diff = max_abs_diff(finals[depth][r], finals[-1][r]);
      EXPECT_EQ(diff, 0.0) << e << " depth " << depth << " rank " << r << ": max |param - no prefetch| = " << diff;
    }
  }
  const double ref_diff = max_abs_diff(finals[1][0], ref.params);
  std::cout << e << ": max |param - one device| = " << ref_diff << "\n";
  if (!e.mixed) {
    EXPECT_TRUE(all_close(finals[1][0], ref.params, 1e-5, 1e-6)) << "equivalence with one device, as in stage 04";
  }
}

INSTANTIATE_TEST_SUITE_P(Stage05, PrefetchBits,
                         ::testing::Values(BitCase{true, 1, false}, BitCase{false, 1, false}, BitCase{true, 2, false},
                                           BitCase{true, 2, true}, BitCase{false, 2, true}),
                         test_support::StreamedName());

TEST(PrefetchOverlap, TheNextUnitsAllGatherIsIssuedBeforeThisUnitsComputeEnds) {
  const TrainConfig c = gpt();
  run_ranks(
      2,
      [&](Communicator& comm) {
        FullyShardedModel fsdp(make_model(c, at::kCPU), comm);
        enable_prefetch(fsdp);
        // At each unit's reshard (its forward, or its backward, is done), which all-gathers had been issued.
        std::map<std::pair<size_t, int>, size_t> gathers_at_reshard;  // (unit, phase) -> all-gathers issued
        std::map<std::pair<size_t, int>, size_t> gather_of;           // (unit, phase) -> its all-gather's index
        int phase = 0;
        size_t gathers = 0;
        UnitLog log(fsdp);
        log.on_event = [&](const fsdp::UnitEvent& e) {
          if (e.kind == UnitEventKind::kBeginUnshard) gather_of[{e.unit, phase}] = gathers++;
          if (e.kind == UnitEventKind::kReshard) gathers_at_reshard[{e.unit, phase}] = gathers;
        };
        const size_t mark = comm.recorder().size();
        at::Tensor loss = fsdp.loss(gpt_batch(c, 0, comm));
        phase = 1;
        loss.backward();
        // The record agrees with the observer: one all-gather per begin_unshard, in the same order.
        size_t recorded = 0;
        for (const auto& r : comm.recorder().since(mark)) recorded += r.op == "all_gather" ? 1 : 0;
        EXPECT_EQ(recorded, gathers) << "every begin_unshard is one all-gather";
        const size_t blocks = static_cast<size_t>(c.layers);
        for (size_t i = 0; i + 1 < blocks; ++i) {
          ASSERT_TRUE(gather_of.count({i + 1, 0}) && gathers_at_reshard.count({i, 0}));
          const size_t issued = gather_of[{i + 1, 0}], ended = gathers_at_reshard[{i, 0}];
          EXPECT_LT(issued, ended) << "forward: block" << i + 1 << "'s all-gather must be issued before block" << i
                                   << "'s forward ends";
        }
        for (size_t i = blocks - 1; i > 0; --i) {
          ASSERT_TRUE(gather_of.count({i - 1, 1}) && gathers_at_reshard.count({i, 1}));
          const size_t issued = gather_of[{i - 1, 1}], ended = gathers_at_reshard[{i, 1}];
          EXPECT_LT(issued, ended) << "backward: block" << i - 1 << "'s all-gather must be issued before block" << i
                                   << "'s backward ends";
        }
      },
      test_group());
}

// The recovery's check, through `log`: the next step on `batch` settles first (by its first new all-gather every other
// unit is sharded, holds no all-gather buffer, and every earlier collective has ended), and its gradients are
// `clean`'s bit for bit; `after` names what came before, for the messages.
void expect_next_step_settles_first(UnitLog& log, FullyShardedModel& fsdp, Communicator& comm, const Batch& batch,
                                    const std::vector<at::Tensor>& clean, const std::string& after) {
  bool checked = false;
  log.on_event = [&](const fsdp::UnitEvent& e) {
    if (checked || e.kind != UnitEventKind::kBeginUnshard) return;
    checked = true;
    for (size_t u = 0; u < fsdp.units().size(); ++u) {
      if (u == e.unit) continue;
      EXPECT_EQ(fsdp.units()[u]->state(), UnitState::kSharded) << fsdp.units()[u]->name();
      EXPECT_EQ(fsdp.units()[u]->all_gather_bytes_held(), 0) << fsdp.units()[u]->name();
    }
    const auto records = comm.recorder().snapshot();  // the last one is the all-gather just issued
    for (size_t i = 0; i + 1 < records.size(); ++i)
      EXPECT_NE(records[i].end_ns, 0) << records[i].op << " " << i << " still in flight";
  };
  for (const auto& p : fsdp.parameters()) p.mutable_grad().reset();
  fsdp.loss(batch).backward();
  log.on_event = nullptr;  // it refers to `checked`, which ends here
  EXPECT_TRUE(checked);
  const auto params = fsdp.parameters();
  for (size_t k = 0; k < params.size(); ++k)
    EXPECT_EQ(test_support::max_diff(params[k].grad(), clean[k]), 0.0)
        << "parameter " << k << ": the step after " << after << " differs from a clean one";
}

// The recovery tests' setting: on 2 ranks, gpt() under FSDP with prefetch 2 deep each way takes a clean step on this
// rank's slice of batch 0; then `body(comm, fsdp, batch, clean)` runs, `clean` a copy of that step's gradients.
template <typename Body>
void after_a_clean_prefetched_step(Body body) {
  const TrainConfig c = gpt();
  run_ranks(
      2,
      [&](Communicator& comm) {
        FullyShardedModel fsdp(make_model(c, at::kCPU), comm);
        auto schedule = enable_prefetch(fsdp, depths(2, 2));
        const Batch batch = gpt_batch(c, 0, comm);
        fsdp.loss(batch).backward();
        body(comm, fsdp, batch, test_support::grad_copies(fsdp.parameters()));
      },
      test_group());
}

TEST(PrefetchRecovery, AfterABackwardThatThrowsTheNextLossSettlesEveryPrefetchFirst) {
  after_a_clean_prefetched_step(
      [](Communicator& comm, FullyShardedModel& fsdp, const Batch& batch, const std::vector<at::Tensor>& clean) {
        for (const auto& p : fsdp.parameters()) p.mutable_grad().reset();
        // A backward cut short in block2: blocks 1 and 0 were prefetched (or are in flight) when it stopped.
        at::Tensor loss = fsdp.loss(batch);
        const at::Tensor& cut = fsdp.units()[2]->params().front().param;
        ASSERT_TRUE(test_support::backward_cut_short_at(cut, [&] { loss.backward(); }));
        bool some_ahead = false;
        for (const auto& unit : fsdp.units()) some_ahead |= unit->state() != UnitState::kSharded;
        EXPECT_TRUE(some_ahead) << "the cut must leave something gathered or in flight, or this tests nothing";
        // The next loss() settles first: by its first new all-gather every unit is sharded, nothing in flight.
        UnitLog log(fsdp);
        expect_next_step_settles_first(log, fsdp, comm, batch, clean, "the failure");
      });
}

TEST(PrefetchRecovery, AfterAForwardThatThrowsTheNextLossSettlesEveryPrefetchFirst) {
  after_a_clean_prefetched_step(
      [](Communicator& comm, FullyShardedModel& fsdp, const Batch& batch, const std::vector<at::Tensor>& clean) {
        // A forward that throws once block1 is gathered (a user's module failing): blocks 2 and 3 are in flight.
        UnitLog log(fsdp);
        const size_t block1 = 1;
        bool thrown = false;
        log.on_event = [&](const fsdp::UnitEvent& e) {
          if (thrown || e.kind != UnitEventKind::kFinishUnshard || e.unit != block1) return;
          thrown = true;
          throw std::runtime_error("a module failed in its forward");
        };
        EXPECT_THROW(fsdp.loss(batch), std::runtime_error);
        ASSERT_TRUE(thrown);
        bool in_flight = false;
        for (const auto& unit : fsdp.units()) in_flight |= unit->state() == UnitState::kUnsharding;
        EXPECT_TRUE(in_flight) << "the throw must leave a prefetch in flight, or this tests nothing";
        // The next loss() settles first: by its first new all-gather every unit is sharded, nothing in flight.
        expect_next_step_settles_first(log, fsdp, comm, batch, clean, "the failed forward");
      });
}

}  // namespace
}  // namespace shardlab::prefetch
