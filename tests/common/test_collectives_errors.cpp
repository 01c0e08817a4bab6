// The Communicator's refusals and failures on real Gloo process groups, ranks as threads: bad arguments at the call,
// a missing rank's timeout, a size mismatch under the check (an exception on every rank, and the group goes on), and
// run_ranks naming the rank that failed.
#include "shardlab/core/comm/thread_ranks.h"
#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <future>
#include <iostream>
#include <string>

namespace shardlab {
namespace {

using test_support::test_group;

TEST(Collectives, BadArgumentsThrowAtTheCallNamingWhatWasExpected) {
  run_ranks(
      1,
      [](Communicator& c) {
        auto expect_message = [](auto&& fn, const std::string& needle) {
          try {
            fn();
            ADD_FAILURE() << "expected std::invalid_argument containing '" << needle << "'";
          } catch (const std::invalid_argument& e) {
            std::cout << "rejected: " << e.what() << "\n";
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
          }
        };
        at::Tensor m = at::ones({4, 4});
        expect_message([&] { c.all_reduce(m.t().narrow(0, 0, 2)); }, "contiguous");
        expect_message([&] { c.all_reduce(at::ones({3}, at::kBool)); }, "dtype");
        expect_message([&] { c.all_reduce(at::ones({3}, at::kLong), ReduceOp::kAvg); }, "floating");
        expect_message([&] { c.broadcast(at::ones({3}), 1); }, "root");
        expect_message([&] { c.all_gather(at::ones({5}), at::ones({3})); }, "elements");
        expect_message([&] { c.all_gather(at::ones({3}, at::kDouble), at::ones({3})); }, "dtype");
        expect_message([&] { c.reduce_scatter(at::ones({2}), at::ones({3})); }, "elements");
        expect_message([&] { c.all_reduce(at::Tensor()); }, "undefined");
        EXPECT_EQ(c.recorder().size(), 0u) << "nothing may be submitted for a rejected call";
      },
      test_group());
}

// Also the rings (all-gather, reduce-scatter), whose steps run on a worker of the Communicator's own.
TEST(Collectives, AMissingRankTimesOutWithTheOpAndRankInTheMessage) {
  for (const std::string op : {"all_reduce", "all_gather", "reduce_scatter"}) {
    GroupOptions o;
    o.timeout = std::chrono::milliseconds(1500);
    std::string message;
    std::promise<void> rank0_done;
    std::shared_future<void> done = rank0_done.get_future().share();
    run_ranks(
        2,
        [&](Communicator& c) {
          if (c.rank() == 1) {
            // Rank 1 never joins, but keeps its group alive until rank 0 has given up: a group destroyed early
            // would close the connection, and rank 0 would see that instead of a timeout.
            done.wait();
            return;
          }
          struct Release {  // however rank 0 leaves, rank 1 is released
            std::promise<void>& p;
            ~Release() { p.set_value(); }
          } release{rank0_done};
          c.set_all_gather_algorithm(AllGatherAlgorithm::kRing);
          c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
          at::Tensor t = at::ones({8}), half = at::ones({4});
          try {
            if (op == "all_reduce") c.all_reduce(t).wait();
            if (op == "all_gather") c.all_gather(t, half).wait();
            if (op == "reduce_scatter") c.reduce_scatter(half, t).wait();
            ADD_FAILURE() << op << ": expected a timeout";
          } catch (const std::runtime_error& e) {
            message = e.what();
          }
        },
        o);
    std::cout << op << " timeout message: " << message << "\n";
    EXPECT_NE(message.find(op), std::string::npos) << message;
    EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
    EXPECT_NE(message.find("timed out (limit 1500 ms)"), std::string::npos) << "a timeout must say it was one";
  }
}

// A caller's mistake that only the other ranks can see: rank 1 passes twice the elements rank 0 does. Unchecked,
// Gloo ends the process on its transport thread (as PyTorch's does); with the check on (Note [Checked
// collectives]) it is an exception on every rank's own thread, at the call, naming both calls, for every kind of
// collective and algorithm, and the group goes on working.
TEST(Collectives, WithTheCheckOnASizeMismatchIsAnExceptionOnEveryRankAndTheGroupGoesOn) {
  struct Case {
    std::string op;
    AllGatherAlgorithm ag = AllGatherAlgorithm::kAuto;
    ReduceScatterAlgorithm rs = ReduceScatterAlgorithm::kAuto;
  };
  for (const Case& k : std::vector<Case>{
           {"all_reduce"},
           {"broadcast"},
           {"all_gather ring", AllGatherAlgorithm::kRing},
           {"all_gather backend", AllGatherAlgorithm::kBackend},
           {"reduce_scatter ring", AllGatherAlgorithm::kAuto, ReduceScatterAlgorithm::kRing},
           {"reduce_scatter all_reduce", AllGatherAlgorithm::kAuto, ReduceScatterAlgorithm::kAllReduce}}) {
    GroupOptions o = test_group();
    o.check_collectives = true;
    std::vector<std::string> messages(2);
    std::vector<size_t> recorded(2);
    std::vector<float> after(2);
    run_ranks(
        2,
        [&](Communicator& c) {
          ASSERT_TRUE(c.checks_collectives());
          c.set_all_gather_algorithm(k.ag);
          c.set_reduce_scatter_algorithm(k.rs);
          const int64_t n = c.rank() == 0 ? 4 : 8;
          at::Tensor t = at::ones({n}), whole = at::ones({2 * n});
          try {
            if (k.op == "all_reduce") c.all_reduce(t).wait();
            if (k.op == "broadcast") c.broadcast(t, 0).wait();
            if (k.op.rfind("all_gather", 0) == 0) c.all_gather(whole, t).wait();
            if (k.op.rfind("reduce_scatter", 0) == 0) c.reduce_scatter(t, whole).wait();
            messages[c.rank()] = "(no error)";
          } catch (const std::invalid_argument& e) {
            messages[c.rank()] = e.what();
          }
          recorded[c.rank()] = c.recorder().size();
          // The group still works: the next (matching) collective is paired with its like.
          at::Tensor x = at::full({3}, static_cast<float>(c.rank() + 1));
          c.all_reduce(x).wait();
          after[c.rank()] = x[0].item<float>();
        },
        o);
    const std::string op = k.op.substr(0, k.op.find(' '));
    const int in0 = op == "reduce_scatter" ? 8 : 4;  // the input's elements: a reduce-scatter's is the whole
    for (int r = 0; r < 2; ++r) {
      std::cout << k.op << ", rank " << r << ": " << messages[r] << "\n";
      const std::string want0 = "rank 0 calls " + op + " of " + std::to_string(in0) + " Float elements";
      const std::string want1 = "rank 1 calls " + op + " of " + std::to_string(2 * in0) + " Float elements";
      EXPECT_NE(messages[r].find(want0), std::string::npos) << messages[r];
      EXPECT_NE(messages[r].find(want1), std::string::npos) << messages[r];
      EXPECT_EQ(messages[r], messages[0]) << "every rank throws the same error";
      EXPECT_EQ(recorded[r], 0u) << k.op << ": nothing of the refused call may be sent";
      EXPECT_EQ(after[r], 3.0f) << k.op << ": the next all-reduce must pair with its like";
    }
  }
  // The same sizes by different paths (the ring on rank 0, Gloo's own all-gather on rank 1) would pair a send with
  // a collective: reported as well.
  GroupOptions o = test_group();
  o.check_collectives = true;
  std::vector<std::string> paths(2);
  run_ranks(
      2,
      [&](Communicator& c) {
        c.set_all_gather_algorithm(c.rank() == 0 ? AllGatherAlgorithm::kRing : AllGatherAlgorithm::kBackend);
        try {
          c.all_gather(at::ones({8}), at::ones({4})).wait();
        } catch (const std::invalid_argument& e) {
          paths[c.rank()] = e.what();
        }
      },
      o);
  for (int r = 0; r < 2; ++r) {
    std::cout << "algorithms, rank " << r << ": " << paths[r] << "\n";
    EXPECT_NE(paths[r].find("by the ring, rank 1 calls all_gather of 4 Float elements (output 8) on cpu, output "
                            "Float on cpu, by the backend"),
              std::string::npos)
        << "rank " << r << ": '" << paths[r] << "'";
  }
}

TEST(Collectives, RunRanksNamesTheFailingRank) {
  try {
    run_ranks(
        3,
        [](Communicator& c) {
          if (c.rank() == 2) throw std::runtime_error("boom");
        },
        test_group());
    FAIL() << "expected an exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 2: boom");
  }
}

}  // namespace
}  // namespace shardlab
