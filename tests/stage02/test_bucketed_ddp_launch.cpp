// Stage 02, task 4 — the ready -> launch -> finish machine: one all-reduce per bucket, in bucket order, the first
// started while backward still runs and none waited for inside a hook; a bucket still reduced on the one rank that
// lacks a gradient, a parameter marked twice named, and every bucket launched through the reducer.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "stage02/bucketed_ddp_support.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/watched_backend.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>

namespace shardlab::bucketed_ddp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

// Structure: per step exactly one all-reduce (average) per bucket, of the bucket's size, in bucket order; the
// rebuild adds one broadcast of the order (int64, one entry per parameter) at the start of step 1.
TEST(BucketedDDP, OneAllReducePerBucketOfTheBucketsSizeInOrder) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        test_support::GptUnderDdp gpt(comm, 3);
        for (int step = 0; step < 3; ++step) {
          compat::zero_grad(*gpt.opt);
          const size_t mark = comm.recorder().size();
          at::Tensor loss = gpt.ddp.loss(rank_slice(gpt.data->global_batch(step, 4), comm.rank(), 2));
          const size_t after_forward = comm.recorder().size();
          loss.backward();
          const auto forward_recs = comm.recorder().since(mark);
          const auto recs = comm.recorder().since(after_forward);
          if (step == 1) {
            ASSERT_EQ(after_forward - mark, 1u) << "the rebuild broadcasts the order once";
            EXPECT_EQ(forward_recs[0].op, "broadcast");
            EXPECT_EQ(forward_recs[0].numel, static_cast<int64_t>(gpt.ddp.parameters().size()));
          } else {
            EXPECT_EQ(after_forward, mark) << "no collective in the forward of step " << step;
          }
          const auto& buckets = gpt.ddp.buckets();
          ASSERT_EQ(recs.size(), buckets.size()) << "step " << step;
          for (size_t b = 0; b < buckets.size(); ++b) {
            EXPECT_EQ(recs[b].op, "all_reduce");
            EXPECT_EQ(recs[b].reduce, "avg");
            EXPECT_EQ(recs[b].numel, buckets[b].numel) << "bucket " << b;
            EXPECT_EQ(recs[b].bytes, buckets[b].numel * 4);
            EXPECT_GT(recs[b].end_ns, 0) << "complete when backward returns";
          }
          if (comm.rank() == 0)
            std::cout << "step " << step << ": " << recs.size() << " all-reduces for " << buckets.size()
                      << " buckets\n";
          gpt.opt->step();
        }
        int64_t total = 0;
        for (const auto& b : gpt.ddp.buckets()) total += b.numel;
        int64_t expected = 0;
        for (const auto& p : trainable_parameters(*gpt.model)) expected += p.numel();
        EXPECT_EQ(total, expected) << "every trainable parameter is in exactly one bucket";
      },
      test_group());
}

TEST(BucketedDDP, FirstBucketStartsBeforeBackwardEnds) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        test_support::GptUnderDdp gpt(comm, 4, {4096, 16384});
        ASSERT_GE(gpt.ddp.buckets().size(), 3u);
        for (int step = 0; step < 3; ++step) {
          const size_t mark = comm.recorder().size();
          at::Tensor loss = gpt.ddp.loss(rank_slice(gpt.data->global_batch(step, 8), comm.rank(), 2));
          const size_t start = comm.recorder().size();
          loss.backward();
          (void)mark;
          const auto recs = comm.recorder().since(start);
          ASSERT_FALSE(recs.empty());
          const int64_t lead = gpt.ddp.backward_compute_end_ns() - recs.front().start_ns;
          if (comm.rank() == 0)
            std::cout << "step " << step << ": first bucket's all-reduce started " << lead / 1000.0
                      << " us before backward finished computing (" << recs.size() << " buckets)\n";
          EXPECT_LT(recs.front().start_ns, gpt.ddp.backward_compute_end_ns())
              << "the first bucket must be launched during backward, not after it";
          EXPECT_LT(recs.front().start_ns, recs.back().start_ns);
        }
      },
      test_group());
}

// A three-layer chain registered out of use order, with layers of three sizes: registered a (6 -> 3, the output
// layer), b (8 -> 6, the input layer), c (6 -> 6, the middle one, skipped on odd steps: batch.step). Under
// kChainCaps the layout in reverse registration order is three buckets of one layer each, told apart by size:
// bucket 0 = c (42 elements), bucket 1 = b (54), bucket 2 = a (21). Backward makes a's gradients ready first, so
// bucket 2 is complete before buckets 0 and 1: it must wait for them.
class Chain : public Model {
 public:
  Chain() {
    a_ = register_module("a", torch::nn::Linear(6, 3));
    b_ = register_module("b", torch::nn::Linear(8, 6));
    c_ = register_module("c", torch::nn::Linear(6, 6));
  }
  at::Tensor loss(const Batch& batch) override {
    at::Tensor h = at::relu(b_->forward(batch.input));
    if (batch.step % 2 == 0) h = at::relu(c_->forward(h));
    return at::nll_loss(at::log_softmax(a_->forward(h), -1), batch.target);
  }

 private:
  torch::nn::Linear a_{nullptr}, b_{nullptr}, c_{nullptr};
};

const BucketCaps kChainCaps{100, 200};  // bytes: c 168 >= 100, b 216 >= 200, a 84 (the rest)

/// A batch of 4 examples for Chain, different per rank and per step; odd steps skip layer c.
Batch chain_batch(int rank, int64_t step) {
  return {at::sin(at::arange(32, at::kFloat).view({4, 8}) * (0.3 + 0.1 * rank) + static_cast<double>(step)),
          at::arange(4, at::kLong).remainder(3).roll(rank + step), step};
}

// Invariant 1 of task 4: buckets go out strictly in bucket order. Here bucket 2 (layer a) is complete first; it
// must wait until buckets 0 and 1 have been launched. Every rank runs the same model, so a machine that launches
// buckets as they complete still pairs its collectives (no hang, no Gloo error): only the order recorded shows it.
TEST(BucketedDDP, ABucketCompleteBeforeTheOnesBeforeItWaitsForThemToLaunch) {
  std::vector<std::vector<std::string>> seen(2), expected(2);
  std::vector<std::vector<size_t>> ready(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Chain>();
        Options options;
        options.caps = kChainCaps;
        options.rebuild_buckets = false;  // keep the layout whose buckets complete out of order
        BucketedDDP ddp(model, comm, options);
        const auto& buckets = ddp.buckets();
        ASSERT_EQ(buckets.size(), 3u);
        ASSERT_EQ(buckets[0].numel, 42);
        ASSERT_EQ(buckets[1].numel, 54);
        ASSERT_EQ(buckets[2].numel, 21);
        for (int step = 0; step < 2; ++step) {
          const size_t mark = comm.recorder().size();
          ddp.loss(chain_batch(comm.rank(), 2 * step)).backward();
          const auto recs = comm.recorder().since(mark);
          std::vector<size_t> launched;  // bucket index of each all-reduce, by its size
          for (const auto& r : recs) {
            auto it = std::find_if(buckets.begin(), buckets.end(), [&](const Bucket& b) { return b.numel == r.numel; });
            launched.push_back(it == buckets.end() ? buckets.size() : static_cast<size_t>(it - buckets.begin()));
          }
          std::ostringstream what;
          what << "step " << step << ": " << recs.size() << " all-reduces, buckets ";
          for (size_t k = 0; k < launched.size(); ++k)
            what << (k ? ", " : "") << launched[k] << " (numel " << recs[k].numel << ")";
          seen[comm.rank()].push_back(what.str());
          expected[comm.rank()].push_back("step " + std::to_string(step) + ": 3 all-reduces, buckets 0 (numel 42), " +
                                          "1 (numel 54), 2 (numel 21)");
          ready[comm.rank()] = ddp.ready_order();
        }
      },
      test_group());
  // The test's premise: layer a's gradients (parameters 0, 1) are ready before c's (4, 5) and b's (2, 3).
  auto pos = [&](size_t i) { return std::find(ready[0].begin(), ready[0].end(), i) - ready[0].begin(); };
  ASSERT_LT(std::max(pos(0), pos(1)), std::min({pos(2), pos(3), pos(4), pos(5)}))
      << "the test needs bucket 2 (layer a) complete before buckets 0 and 1";
  for (int r = 0; r < 2; ++r)
    for (size_t s = 0; s < seen[r].size(); ++s) {
      std::cout << "rank " << r << " " << seen[r][s] << "\n";
      EXPECT_EQ(seen[r][s], expected[r][s])
          << "rank " << r << ": every bucket is launched once per backward, strictly in bucket order (task 4, "
          << "invariant 1): bucket 2 is complete first and waits until buckets 0 and 1 are out, then goes too; "
          << "launching a bucket as soon as it is complete lets ranks whose gradients arrive in different orders "
          << "issue different collectives";
    }
}

// Invariant 2 of task 4: nothing waits inside a hook. The backend below notes when each all-reduce is waited for:
// every wait must come after backward finished computing (backward_compute_end_ns, when the end-of-backward
// callback began), none while a hook runs. A machine that waits for each bucket as it launches it still gives
// the right gradients, and still starts the first bucket before backward ends; only the time of the waits shows it.
TEST(BucketedDDP, NoBucketIsWaitedForBeforeBackwardFinishesComputing) {
  std::vector<Watch> watches(2);
  std::vector<std::vector<std::string>> early(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 8);
        Options options;
        options.caps = mlp_caps(3);  // [fc2.*] [fc1.*] [fc0.*]: two buckets go out while backward runs
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset("mlp", 8);
        Watch& watch = watches[comm.rank()];
        for (int step = 0; step < 3; ++step) {  // step 1 rebuilds: its broadcast is no all-reduce
          at::Tensor loss = ddp.loss(rank_slice(data->global_batch(step, 8), comm.rank(), 2));
          size_t from = 0;
          {
            std::lock_guard<std::mutex> lock(watch.mu);
            from = watch.waited_ns.size();
          }
          loss.backward();
          std::lock_guard<std::mutex> lock(watch.mu);
          const size_t waits = watch.waited_ns.size() - from;
          EXPECT_EQ(waits, ddp.buckets().size())
              << "rank " << comm.rank() << " step " << step << ": one wait per bucket, by the time backward returns";
          for (size_t k = from; k < watch.waited_ns.size(); ++k)
            if (watch.waited_ns[k] < ddp.backward_compute_end_ns())
              early[comm.rank()].push_back("step " + std::to_string(step) + ": wait " + std::to_string(k - from) +
                                           " came " +
                                           std::to_string((ddp.backward_compute_end_ns() - watch.waited_ns[k]) / 1000) +
                                           " us before backward finished computing");
        }
      },
      watched_group(watches));
  for (int r = 0; r < 2; ++r) {
    std::string list;
    for (const auto& e : early[r]) list += "\n  " + e;
    std::cout << "rank " << r << ": " << early[r].size() << " bucket all-reduces waited for during backward\n";
    EXPECT_TRUE(early[r].empty()) << "rank " << r << ": a bucket's all-reduce was waited for while backward was "
                                  << "still computing (task 4, invariant 2: never wait inside a hook; mark_ready "
                                  << "launches and returns, only finish_backward and wait_launched wait):" << list;
  }
}

/// "all_reduce 42, all_reduce 54, all_reduce 21": the collectives of `recs`, by op and size.
std::string show_collectives(const std::vector<CollectiveRecord>& recs) {
  std::string s;
  for (const auto& r : recs) s += (s.empty() ? "" : ", ") + r.op + " " + std::to_string(r.numel);
  return s.empty() ? "none" : s;
}

// Invariant 3 of task 4, on ONE rank: rank 1 skips layer c in its synchronized micro-batch (after a no_sync
// micro-batch that used it); rank 0 uses every layer, so it launches c's bucket during backward and waits in it.
// Rank 1 must launch that bucket too, at the end of its backward, with c's slots as they are (what its no_sync
// micro-batch accumulated), and only then raise the error that names c's parameters. (UnusedParameterIsAnError...
// misses the parameter on every rank: there, skipping its bucket everywhere pairs up and nothing waits.)
TEST(BucketedDDP, AParameterWithoutGradientOnOneRankOnlyIsStillReducedThere) {
  std::vector<std::string> errors(2);
  std::vector<std::vector<CollectiveRecord>> recs(2);
  std::vector<std::vector<at::Tensor>> accumulated(2), synced(2);
  std::vector<std::string> names;
  std::string buckets;
  // The step after the error, every layer used on both ranks: its collectives, its error, whether it rebuilt.
  std::vector<std::vector<CollectiveRecord>> after(2);
  std::vector<std::string> after_errors(2);
  std::vector<int> rebuilt(2, -1);
  GroupOptions group = test_group();
  group.timeout = std::chrono::milliseconds(10'000);  // a rank left waiting in a bucket fails after 10 s, not 30
  run_ranks(
      2,
      [&](Communicator& comm) {
        const int rank = comm.rank();
        auto model = std::make_shared<Chain>();
        Options options;
        options.caps = kChainCaps;  // find_unused_parameters false: a missing gradient is an error, after the sync
        BucketedDDP ddp(model, comm, options);
        const auto params = ddp.parameters();
        const Batch first = chain_batch(rank, 0);                   // every layer, inside no_sync
        const Batch second = chain_batch(rank, rank == 0 ? 2 : 1);  // rank 1: an odd step, layer c skipped
        const auto own_first = test_support::local_gradients(*model, first, params);
        const auto own_second = test_support::local_gradients(*model, second, params);
        for (size_t i = 0; i < params.size(); ++i)
          accumulated[rank].push_back(own_second[i].defined() ? own_first[i] + own_second[i] : own_first[i]);
        {
          auto scope = ddp.no_sync();
          ddp.loss(first).backward();
        }
        const size_t mark = comm.recorder().size();
        try {
          ddp.loss(second).backward();
        } catch (const std::exception& e) {
          errors[rank] = e.what();
        }
        recs[rank] = comm.recorder().since(mark);
        for (const auto& p : params) synced[rank].push_back(p.grad().clone());
        if (rank == 0) {
          names = ddp.parameter_names();
          for (const auto& b : ddp.buckets()) buckets += (buckets.empty() ? "" : ", ") + std::to_string(b.numel);
        }
        const size_t before_next = comm.recorder().size();
        try {
          ddp.loss(first).backward();
        } catch (const std::exception& e) {
          after_errors[rank] = e.what();
        }
        after[rank] = comm.recorder().since(before_next);
        rebuilt[rank] = ddp.rebuilt() ? 1 : 0;
      },
      group);
  for (int r = 0; r < 2; ++r)
    std::cout << "rank " << r << ": " << show_collectives(recs[r]) << "; error: " << errors[r].substr(0, 200) << "\n";
  EXPECT_EQ(show_collectives(recs[1]), show_collectives(recs[0]))
      << "rank 1 (no gradient for layer c) and rank 0 (every gradient) must issue the same collectives, in the same "
      << "order (task 4, invariant 3): finish_backward launches every bucket that is not out yet, the missing "
      << "parameters' slots reduced as they are, before the error is raised; rank 0 waits in that bucket's "
      << "all-reduce (rank 0's error: " << (errors[0].empty() ? "none" : errors[0].substr(0, 160)) << ")";
  EXPECT_EQ(show_collectives(recs[0]), "all_reduce 42, all_reduce 54, all_reduce 21")
      << "one all-reduce per bucket (numel " << buckets << "), in bucket order";
  EXPECT_TRUE(errors[0].empty()) << "rank 0 had every gradient; its backward threw: " << errors[0];
  EXPECT_NE(errors[1].find("'c.weight', 'c.bias'"), std::string::npos)
      << "rank 1's backward must throw naming layer c's parameters, in index order (finish_backward returns the "
      << "parameters not marked ready in index order); got: " << errors[1];
  ASSERT_EQ(synced[0].size(), names.size());
  ASSERT_EQ(synced[1].size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const at::Tensor want = test_support::mean_of_two(accumulated[0][i], accumulated[1][i]);
    for (int r = 0; r < 2; ++r)
      EXPECT_TRUE(at::equal(synced[r][i], want))
          << "rank " << r << " '" << names[i] << "': .grad() is not the average of what the ranks accumulated (max "
          << "diff " << test_support::max_diff(synced[r][i], want) << "; if rank 1's slot of a missing parameter "
          << "had been zeroed instead of reduced as it is: "
          << test_support::max_diff(synced[r][i], test_support::mean_of_two(accumulated[0][i], at::zeros_like(want)))
          << ")";
  }
  // The backward that threw on rank 1 was, on rank 0, the first synchronized backward that completed: whether the
  // buckets are rebuilt at the next forward (a broadcast) must not depend on what this rank's gradients did, or
  // rank 0 broadcasts while rank 1 all-reduces.
  for (int r = 0; r < 2; ++r)
    std::cout << "the step after, rank " << r << ": " << show_collectives(after[r]) << "; rebuilt " << rebuilt[r]
              << "; error: " << after_errors[r].substr(0, 160) << "\n";
  EXPECT_EQ(show_collectives(after[1]), show_collectives(after[0]))
      << "after the backward that threw on rank 1 only, the next step issues different collectives on the two "
      << "ranks: the rebuild is pending on one rank and not on the other";
  EXPECT_EQ(rebuilt[1], rebuilt[0]) << "one rank rebuilt its buckets and the other did not";
  EXPECT_TRUE(after_errors[0].empty() && after_errors[1].empty())
      << "the step after failed: rank 0: " << after_errors[0].substr(0, 200)
      << "; rank 1: " << after_errors[1].substr(0, 200);
}

// Invariant 4 of task 4: a parameter is marked at most once per backward; a second mark throws std::logic_error
// naming it. The public path that reaches it: find_unused_parameters and two losses summed, the later one not using
// layer c. Backward reaches the later loss first (autograd runs the most recently built nodes first): its hook marks
// c's parameters ready as unused in its graph; then the other loss's gradient for c arrives and marks them again.
// (Each parameter's accumulator runs once per backward, so without find_unused_parameters no second mark happens:
// a tied weight, a parameter used twice, two losses summed all accumulate once.)
TEST(BucketedDDP, FindUnusedParametersWithTwoLossesSummedMarksAParameterTwiceAndThrowsNamingIt) {
  std::vector<std::string> errors(2), kinds(2);
  std::vector<std::vector<at::Tensor>> own(2), next(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        const int rank = comm.rank();
        auto model = std::make_shared<Chain>();
        Options options;
        options.caps = kChainCaps;
        options.find_unused_parameters = true;
        BucketedDDP ddp(model, comm, options);
        at::Tensor uses_c = ddp.loss(chain_batch(rank, 0));
        at::Tensor skips_c = ddp.loss(chain_batch(rank, 1));  // built later: backward reaches it first
        try {
          (uses_c + skips_c).backward();
          kinds[rank] = "no exception";
        } catch (const std::logic_error& e) {
          kinds[rank] = "std::logic_error";
          errors[rank] = e.what();
        } catch (const std::exception& e) {
          kinds[rank] = "another exception";
          errors[rank] = e.what();
        }
        // Nothing stays half-marked or in flight: the next step (its forward settles the one that threw) averages.
        const Batch after = chain_batch(rank, 2);
        own[rank] = test_support::local_gradients(*model, after, ddp.parameters());
        at::Tensor loss = ddp.loss(after);
        for (const auto& p : ddp.parameters()) p.grad().zero_();
        loss.backward();
        for (const auto& p : ddp.parameters()) next[rank].push_back(p.grad().clone());
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    std::cout << "rank " << r << ": " << kinds[r] << ": " << errors[r] << "\n";
    EXPECT_EQ(kinds[r], "std::logic_error")
        << "rank " << r << ": a parameter marked ready twice in one backward (layer c: unused in one loss's graph, "
        << "then given a gradient by the other) must throw std::logic_error naming it (task 4, invariant 4); got: "
        << errors[r];
    EXPECT_NE(errors[r].find("'c."), std::string::npos) << "the error names the parameter: " << errors[r];
    for (size_t i = 0; i < next[r].size(); ++i) {
      const at::Tensor want = test_support::mean_of_two(own[0][i], own[1][i]);
      EXPECT_TRUE(at::equal(next[r][i], want))
          << "rank " << r << " parameter " << i << ": the step after the "
          << "error is not averaged (max diff " << test_support::max_diff(next[r][i], want) << ")";
    }
  }
}

// mark_ready launches through reduce() (given), which calls Options::reducer when one is set: stage 03 plugs its
// communication hooks in there. A reducer that notes each bucket and averages it must see every bucket, once per
// backward, in bucket order.
TEST(BucketedDDP, EveryBucketIsLaunchedThroughTheReducer) {
  std::vector<std::vector<int64_t>> seen(2), want(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 16);
        std::vector<int64_t>* mine = &seen[comm.rank()];
        Options options;
        options.caps = mlp_caps(3);
        options.reducer = [mine](Communicator& c, const at::Tensor& bucket) {
          mine->push_back(bucket.numel());
          return c.all_reduce(bucket, ReduceOp::kAvg);
        };
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset("mlp", 16);
        for (int step = 0; step < 2; ++step) {
          ddp.loss(rank_slice(data->global_batch(step, 8), comm.rank(), 2)).backward();
          for (const auto& b : ddp.buckets()) want[comm.rank()].push_back(b.numel);
        }
      },
      test_group());
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(seen[r], want[r]) << "rank " << r << ": the numel of each bucket the reducer was given, over two "
                                << "steps, vs the buckets': mark_ready launches every bucket through reduce() (which "
                                << "calls Options::reducer), once per backward, in bucket order; not through the "
                                << "Communicator directly";
}

}  // namespace
}  // namespace shardlab::bucketed_ddp
