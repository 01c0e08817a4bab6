// Tests of progress points (Note [Yielding to communication]): a CPU collective is counted in flight from its
// submission until it completes, and backward yields at each gradient-ready point only while one is in flight and
// yielding is on. Structure only: what was counted and how many yields, never how long anything took.
#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/comm/progress.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/model/grad_ready.h"
#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace shardlab {
namespace {

using test_support::test_group;

// Rank 1 joins rank 0's all-reduce only once rank 0 says so: until then that collective is in flight on rank 0.
void hold_then_join(Communicator& c, std::atomic<bool>& release) {
  while (!release.load()) std::this_thread::yield();
  at::Tensor t = at::ones({4});
  c.all_reduce(t).wait();
}

// Rank 0's side: releases rank 1 and turns yielding back on however rank 0's body ends (an early return from a failed
// ASSERT, or an exception, must not leave rank 1 spinning until ctest's timeout).
struct Release {
  std::atomic<bool>& release;
  ~Release() {
    set_yield_to_communication(true);
    release = true;
  }
};

TEST(Progress, ACpuCollectiveIsInFlightFromSubmissionUntilItCompletes) {
  const int64_t base = collectives_in_flight();
  std::atomic<bool> release{false};
  int64_t pending = -1;
  run_ranks(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) return hold_then_join(c, release);
        Release on_exit{release};
        at::Tensor t = at::ones({4});
        Handle h = c.all_reduce(t);
        pending = collectives_in_flight() - base;  // rank 1 has not submitted its half yet
        release = true;
        h.wait();
        EXPECT_TRUE(at::equal(t, at::full({4}, 2.0f)));
      },
      test_group());
  EXPECT_EQ(pending, 1) << "rank 0's all-reduce, submitted and not complete, must be counted once";
  EXPECT_EQ(collectives_in_flight(), base) << "both ranks waited: nothing may stay counted";
}

TEST(Progress, BackwardYieldsAtEachGradientOnlyWhileACollectiveIsInFlightAndYieldingIsOn) {
  ASSERT_TRUE(yield_to_communication()) << "progress points are on by default";
  std::atomic<bool> release{false};
  uint64_t idle = 0, in_flight = 0, switched_off = 0;
  size_t ready_calls = 0;
  run_ranks(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) return hold_then_join(c, release);
        Release on_exit{release};
        std::vector<at::Tensor> params{at::randn({3}).set_requires_grad(true), at::randn({2}).set_requires_grad(true),
                                       at::randn({5}).set_requires_grad(true)};
        GradientReadiness readiness(
            params, [&](size_t) { ++ready_calls; }, [] {});
        auto backward = [&] {
          const uint64_t before = progress_yields();
          (params[0].sum() * params[1].sum() + params[2].pow(2).sum()).backward();
          return progress_yields() - before;
        };
        idle = backward();  // nothing in flight
        at::Tensor t = at::ones({4});
        Handle h = c.all_reduce(t);  // in flight until rank 1 joins
        in_flight = backward();
        set_yield_to_communication(false);
        switched_off = backward();
        set_yield_to_communication(true);
        release = true;
        h.wait();
      },
      test_group());
  EXPECT_EQ(ready_calls, 9u) << "three backwards of three parameters";
  EXPECT_EQ(idle, 0u) << "no collective in flight: a progress point must not yield";
  EXPECT_EQ(in_flight, 3u) << "one yield per gradient-ready point while the all-reduce was in flight";
  EXPECT_EQ(switched_off, 0u) << "set_yield_to_communication(false) must turn the yields off";
}

// Every path through submit (native Gloo ops, the ring's worker thread, the all-reduce fallback, the blocking barrier)
// leaves nothing counted once waited for (a token kept alive by a callback or a handle would stay counted).
TEST(Progress, NoKindOfCollectiveStaysCountedOnceWaitedFor) {
  const int64_t base = collectives_in_flight();
  run_ranks(
      2,
      [&](Communicator& c) {
        at::Tensor t = at::ones({4}), gathered = at::empty({8}), chunk = at::empty({2});
        c.all_reduce(t, ReduceOp::kAvg).wait();
        c.broadcast(t, 1).wait();
        c.all_gather(gathered, t).wait();
        c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);  // send/recv on a worker thread
        c.reduce_scatter(chunk, t).wait();
        c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kAllReduce);
        c.reduce_scatter(chunk, t).wait();
        c.barrier();
        EXPECT_TRUE(at::equal(chunk, at::full({2}, 2.0f)));
      },
      test_group());
  EXPECT_EQ(collectives_in_flight(), base) << "every collective was waited for: none may stay counted";
}

// The backend's completion callback alone ends the count: nobody has waited yet.
TEST(Progress, TheBackendsCompletionEndsTheCountBeforeAnyWait) {
  const int64_t base = collectives_in_flight();
  run_ranks(
      2,
      [&](Communicator& c) {
        at::Tensor t = at::ones({4});
        Handle h = c.all_reduce(t);
        // Both ranks submitted, so it completes without a wait; poll for that (bounded by the group's timeout).
        const int64_t deadline = now_ns() + int64_t{30'000'000'000};
        while (collectives_in_flight() != base && now_ns() < deadline) std::this_thread::yield();
        EXPECT_EQ(collectives_in_flight(), base) << "completed all-reduces must not be counted before wait()";
        h.wait();
      },
      test_group());
}

TEST(Progress, AnEndedCollectiveIsNotCountedTwice) {
  const int64_t base = collectives_in_flight();
  {
    detail::InFlight one;
    EXPECT_EQ(collectives_in_flight(), base + 1);
    one.end();
    one.end();  // the waiting thread after the backend's callback: idempotent
    EXPECT_EQ(collectives_in_flight(), base);
  }  // and the destructor of an ended one does nothing
  EXPECT_EQ(collectives_in_flight(), base);
  { detail::InFlight dropped; }  // never ended: its owner went away
  EXPECT_EQ(collectives_in_flight(), base) << "a collective whose owner went away must not stay counted";
}

}  // namespace
}  // namespace shardlab
