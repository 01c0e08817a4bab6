// Asynchrony on real Gloo process groups, ranks as threads: a collective gives control back before it completes and the
// barrier does not return before every rank called it; Handle's rules (finish steps, moves, then_issue, on_advance);
// comm_time's busy and exposed time.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <iostream>
#include <string>

namespace shardlab {
namespace {

using test_support::test_group;

// all_reduce gives control back while the collective cannot have completed: rank 1 joins it only after rank 0 has
// returned from issuing it and said so. A blocking all_reduce never returns on rank 0 (its peer is not there yet),
// and fails by the group's timeout instead. wait() then makes the result visible.
TEST(Collectives, AsyncWorkOverlapsTheCallingThread) {
  std::promise<void> issued;
  std::shared_future<void> rank0_returned = issued.get_future().share();
  run_ranks(
      2,
      [&](Communicator& c) {
        at::Tensor t = at::ones({1 << 16});
        if (c.rank() == 1) {
          rank0_returned.wait();
          c.all_reduce(t).wait();
          EXPECT_EQ(t[0].item<float>(), 2.0f);
          return;
        }
        struct Release {  // however rank 0 leaves (a blocking all_reduce throws its timeout), rank 1 is released
          std::promise<void>& p;
          bool released = false;
          void now() {
            if (!released) p.set_value();
            released = true;
          }
          ~Release() { now(); }
        } release{issued};
        Handle h = c.all_reduce(t);
        EXPECT_FALSE(h.done());
        EXPECT_EQ(c.recorder().snapshot().back().end_ns, 0) << "complete although rank 1 has not joined yet";
        release.now();
        h.wait();
        EXPECT_TRUE(h.done());
        EXPECT_EQ(t[0].item<float>(), 2.0f);
        EXPECT_GT(c.recorder().snapshot().back().end_ns, 0) << "wait() returns with the record closed";
        h.wait();  // a second wait is a no-op
      },
      test_group());
}

// barrier() returns on no rank before every rank has called it. Rank 1 holds back before calling it, until rank 0
// has returned from its own barrier (which a barrier that does not block lets it do at once) or for a second at
// most; rank 0 then checks that rank 1 had arrived. A correct barrier passes however long rank 1 holds back: the
// hold-back only gives a barrier that does not wait the time to show it.
TEST(Collectives, BarrierReturnsOnlyOnceEveryRankHasCalledIt) {
  std::promise<void> returned;
  std::shared_future<void> rank0_returned = returned.get_future().share();
  std::atomic<bool> rank1_arrived{false};
  bool arrived_when_rank0_returned = false, rank0_returned_first = false;
  run_ranks(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) {
          rank0_returned_first = rank0_returned.wait_for(std::chrono::seconds(1)) == std::future_status::ready;
          rank1_arrived = true;
          c.barrier();
        } else {
          struct Release {
            std::promise<void>& p;
            ~Release() { p.set_value(); }
          } release{returned};
          c.barrier();
          arrived_when_rank0_returned = rank1_arrived;
        }
        const auto recs = c.recorder().snapshot();
        ASSERT_EQ(recs.size(), 1u);
        EXPECT_EQ(recs[0].op, "barrier");
        EXPECT_GT(recs[0].end_ns, 0) << "barrier() returns with its record closed";
      },
      test_group());
  EXPECT_FALSE(rank0_returned_first) << "rank 0's barrier returned while rank 1 held back from calling barrier()";
  EXPECT_TRUE(arrived_when_rank0_returned) << "rank 0's barrier returned before rank 1 had called barrier()";
}

// Handle: finish steps run exactly once, even when one throws, and a failure is never reported as success later.
TEST(Handle, FinishStepsRunOnceAndAFailureSticks) {
  int first = 0, second = 0;
  Handle h(
      c10::intrusive_ptr<compat::Work>(), [&] { ++first; }, "test op", std::chrono::milliseconds(1000));
  Handle chained = std::move(h).then([&] {
    ++second;
    throw std::runtime_error("post step failed");
  });
  EXPECT_TRUE(h.done()) << "then() consumes the handle";
  EXPECT_THROW(chained.wait(), std::runtime_error);
  EXPECT_THROW(chained.wait(), std::runtime_error) << "a failed handle keeps failing";
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 1) << "finish steps never run twice";
  int later = 0;
  Handle done;
  Handle after_done = std::move(done).then([&] { ++later; });
  EXPECT_EQ(later, 0) << "the step runs at wait(), not at then()";
  after_done.wait();
  after_done.wait();
  EXPECT_EQ(later, 1);
}

// Moving onto a pending handle would drop its finish step (Note [Overwriting a pending Handle]): it throws, naming
// the op, and leaves both handles as they were; onto a handle that is done it moves.
TEST(Handle, MoveAssigningOntoAPendingHandleThrowsNamingItsOpAndMovesNothing) {
  int first = 0, second = 0;
  Handle pending(
      c10::intrusive_ptr<compat::Work>(), [&] { ++first; }, "all_reduce on group 'test' (rank 0 of 2)",
      std::chrono::milliseconds(1000));
  Handle other(
      c10::intrusive_ptr<compat::Work>(), [&] { ++second; }, "broadcast on group 'test' (rank 0 of 2)",
      std::chrono::milliseconds(1000));
  try {
    pending = std::move(other);
    ADD_FAILURE() << "expected std::logic_error: the pending all_reduce's finish step would be lost";
  } catch (const std::logic_error& e) {
    std::cout << "rejected: " << e.what() << "\n";
    EXPECT_NE(std::string(e.what()).find("all_reduce on group 'test' (rank 0 of 2)"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(pending.done()) << "the pending handle stays pending";
  EXPECT_FALSE(other.done()) << "nothing was moved out of the source";
  pending.wait();
  EXPECT_EQ(first, 1) << "the finish step of the handle that was kept runs at its wait()";
  pending = std::move(other);  // done now: it may be overwritten
  EXPECT_TRUE(other.done()) << "the source of a move is a completed handle";
  EXPECT_FALSE(pending.done());
  pending.wait();
  EXPECT_EQ(second, 1);
  EXPECT_EQ(first, 1);
}

// then_issue: the second collective starts at advance() (once, after the first landed), not at then_issue() and not
// only at wait(); wait() finishes both and runs the steps chained after them; a plain handle's advance() is its
// wait(); a failing issue() sticks and is never retried. Two ranks, two groups: the order of each group's
// collectives is the same on both.
TEST(Handle, ThenIssueStartsTheSecondCollectiveAtAdvanceOnceAndWaitFinishesBoth) {
  run_world(
      2,
      [](World& world) {
        Communicator& all = world.world();
        Communicator& other = world.group("pair", {0, 1});
        const double r = all.rank() + 1;
        at::Tensor x = at::full({4}, r), y = at::full({3}, 10 * r);
        std::vector<std::string> steps;
        const size_t start = all.recorder().size();
        Handle chained = all.all_reduce(x)
                             .then_issue([&] {
                               steps.push_back("issue");
                               return other.all_reduce(y);
                             })
                             .then([&] { steps.push_back("after"); });
        EXPECT_TRUE(steps.empty()) << "nothing is issued before advance()";
        EXPECT_FALSE(chained.done());
        chained.advance();
        chained.advance();
        EXPECT_EQ(steps, std::vector<std::string>{"issue"}) << "advance() issues the second collective once";
        EXPECT_TRUE(at::equal(x, at::full({4}, 3.0))) << "the first collective landed before the second was issued";
        EXPECT_FALSE(chained.done()) << "the second is still to be waited for";
        chained.wait();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "after"}));
        EXPECT_TRUE(at::equal(y, at::full({3}, 30.0))) << y;
        std::vector<std::string> groups;
        for (const auto& rec : all.recorder().since(start)) groups.push_back(rec.group);
        EXPECT_EQ(groups, (std::vector<std::string>{all.name(), other.name()})) << "first on the world, then the pair";

        Handle plain = all.all_reduce(x);
        plain.advance();
        EXPECT_TRUE(plain.done()) << "a one-collective handle's advance() is its wait()";

        int issued = 0;
        Handle failing = all.all_reduce(x).then_issue([&]() -> Handle {
          ++issued;
          throw std::runtime_error("issue failed");
        });
        EXPECT_THROW(failing.advance(), std::runtime_error);
        EXPECT_THROW(failing.advance(), std::runtime_error) << "the failure sticks";
        EXPECT_THROW(failing.wait(), std::runtime_error) << "and wait() reports it";
        EXPECT_EQ(issued, 1) << "a failed issue() is never retried";
      },
      test_group());
}

// on_advance: a chained handle runs the step when advance() has issued the second collective (before the second is
// waited for), exactly once; a plain handle, or a chained one waited for without an advance, at wait().
TEST(Handle, OnAdvanceRunsOnceWhenTheFirstPhaseHasLandedOrAtWait) {
  run_world(
      2,
      [](World& world) {
        Communicator& all = world.world();
        Communicator& other = world.group("pair", {0, 1});
        at::Tensor x = at::ones({4}), y = at::ones({3});
        std::vector<std::string> steps;
        Handle chained = all.all_reduce(x)
                             .then_issue([&] {
                               steps.push_back("issue");
                               return other.all_reduce(y);
                             })
                             .on_advance([&] { steps.push_back("advanced"); })
                             .then([&] { steps.push_back("after"); });
        EXPECT_TRUE(steps.empty());
        chained.advance();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "advanced"})) << "the step runs at advance()";
        chained.advance();
        chained.wait();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "advanced", "after"})) << "and never again";

        steps.clear();
        Handle unadvanced = all.all_reduce(x)
                                .then_issue([&] {
                                  steps.push_back("issue");
                                  return other.all_reduce(y);
                                })
                                .on_advance([&] { steps.push_back("advanced"); });
        unadvanced.wait();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "advanced"})) << "wait() without advance() runs it too";

        steps.clear();
        Handle plain =
            all.all_reduce(x).then([&] { steps.push_back("finish"); }).on_advance([&] { steps.push_back("advanced"); });
        plain.advance();
        EXPECT_EQ(steps, (std::vector<std::string>{"finish", "advanced"})) << "a plain handle: after its own finish";
      },
      test_group());
}

// comm_time: busy is the union of the closed collectives' spans, exposed the part of it inside the waits (their
// union too), both clipped to the window; a pending collective (end 0) counts for nothing.
TEST(CommTime, BusyIsTheUnionOfTheSpansAndExposedItsPartInsideTheWaitsWithinTheWindow) {
  auto span = [](int64_t start, int64_t end) {
    CollectiveRecord r;
    r.op = "all_reduce";
    r.start_ns = start;
    r.end_ns = end;
    return r;
  };
  auto wait = [](int64_t start, int64_t end) { return WaitRecord{"ddp sync", start, end}; };
  // Window [100, 200). Collectives, out of order: [190, 250) is cut to [190, 200); [90, 120) and [110, 130)
  // overlap: [100, 130); [150, 160); [170, pending) and [300, 400) count for nothing. Busy: 30 + 10 + 10 = 50.
  const std::vector<CollectiveRecord> records{span(190, 250), span(110, 130), span(300, 400),
                                              span(90, 120),  span(150, 160), span(170, 0)};
  // Waits: [115, 155) and [118, 125) (inside it, counted once) cover [115, 130) and [150, 155) of the busy time;
  // [140, 145) covers none; [195, 205) covers [195, 200). Exposed: 15 + 5 + 5 = 25.
  const std::vector<WaitRecord> waits{wait(195, 205), wait(115, 155), wait(140, 145), wait(118, 125)};
  const CommTime t = comm_time(records, waits, 100, 200);
  std::cout << "busy " << t.busy_ns << " (expected 50), exposed " << t.exposed_ns << " (expected 25)\n";
  EXPECT_EQ(t.busy_ns, 50);
  EXPECT_EQ(t.exposed_ns, 25);
  const CommTime none = comm_time(records, waits, 400, 500);
  EXPECT_EQ(none.busy_ns, 0) << "nothing in the window";
  EXPECT_EQ(none.exposed_ns, 0);
  const CommTime no_waits = comm_time(records, {}, 0, 1000);
  EXPECT_EQ(no_waits.busy_ns, 40 + 10 + 60 + 100) << "[90, 130), [150, 160), [190, 250), [300, 400)";
  EXPECT_EQ(no_waits.exposed_ns, 0) << "no wait: all of it hidden";
}

// Work done inside a wait (stage 03's optimizer steps in a handle's continuation) is cut out of the wait spans, so
// communication during it counts as hidden.
TEST(CommTime, BusySpansInsideAWaitAreNotWaiting) {
  CommRecorder rec;
  rec.record_wait("ddp sync", 100, 200);
  rec.record_wait("ddp sync", 300, 310);
  rec.record_busy(120, 130);
  rec.record_busy(150, 170);
  rec.record_busy(190, 250);  // runs past the wait's end
  rec.record_busy(300, 310);  // all of the second wait
  const std::vector<WaitRecord> waits = rec.waits();
  std::string got;
  for (const auto& w : waits) got += "[" + std::to_string(w.start_ns) + "," + std::to_string(w.end_ns) + ")";
  std::cout << "waits left: " << got << "\n";
  EXPECT_EQ(got, "[100,120)[130,150)[170,190)");
  CollectiveRecord r;
  r.op = "all_reduce";
  r.start_ns = 100;
  r.end_ns = 200;
  const CommTime t = comm_time({r}, waits, 0, 1000);
  EXPECT_EQ(t.busy_ns, 100);
  EXPECT_EQ(t.exposed_ns, 20 + 20 + 20) << "only the time the thread really waited";
}

}  // namespace
}  // namespace shardlab
