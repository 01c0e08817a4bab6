// Stage 02 — bucketed DDP's errors: a double backward, an unused parameter and ranks whose models differ are named on
// every rank; after a backward that threw or a bucket that failed, every launched bucket is waited for and the next
// step averages exactly.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "stage02/bucketed_ddp_support.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/refusal.h"
#include "support/watched_backend.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <mutex>
#include <string>

namespace shardlab::bucketed_ddp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

TEST(BucketedDDP, DoubleBackwardIsAnErrorThatNamesAParameter) {
  std::vector<std::string> errors(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 2);
        BucketedDDP ddp(model, comm);
        auto data = make_dataset("mlp", 2);
        try {
          ddp.loss(rank_slice(data->global_batch(0, 8), comm.rank(), 2))
              .backward({}, /*retain_graph=*/true,
                        /*create_graph=*/true);
        } catch (const std::exception& e) {
          errors[comm.rank()] = e.what();
        }
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    std::cout << "rank " << r << ": " << errors[r].substr(0, 160) << "\n";
    EXPECT_NE(errors[r].find("create_graph"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("parameter 'fc"), std::string::npos) << errors[r];
  }
}

TEST(BucketedDDP, UnusedParameterIsAnErrorThatNamesIt) {
  std::vector<std::string> errors(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("edge", 6);
        BucketedDDP ddp(model, comm);  // find_unused_parameters = false
        auto data = make_dataset("edge", 6);
        ddp.loss(rank_slice(data->global_batch(0, 8), comm.rank(), 2)).backward();  // even step: all used
        try {
          ddp.loss(rank_slice(data->global_batch(1, 8), comm.rank(), 2)).backward();  // odd: `sometimes` unused
        } catch (const std::exception& e) {
          errors[comm.rank()] = e.what();
        }
        // the wrapper is usable again afterwards (nothing left pending)
        ddp.loss(rank_slice(data->global_batch(2, 8), comm.rank(), 2)).backward();
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    std::cout << "rank " << r << ": " << errors[r] << "\n";
    EXPECT_NE(errors[r].find("'sometimes'"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("find_unused_parameters"), std::string::npos) << errors[r];
  }
}

// Invariant 5 of task 4: a backward that throws after some buckets were launched leaves them in flight; the next
// forward must wait for every one (wait_launched) before the machine starts afresh, and the next step must average
// exactly. Waiting is what finishes an average (Gloo has no AVG: the Communicator sums and divides in wait(), see
// Note [Fallbacks]), so an empty wait_launched leaves the launched buckets holding the ranks' sum, not their mean.
TEST(BucketedDDP, TheForwardAfterABackwardThatThrewSettlesTheBucketsItLaunched) {
  std::vector<size_t> launched(2), completed(2);
  std::vector<std::vector<at::Tensor>> own_aborted(2), settled(2), own_next(2), next(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 13);
        Options options;
        options.caps = mlp_caps(3);  // [fc2.*] [fc1.*] [fc0.*]: the first two are out before fc0's gradients
        options.rebuild_buckets = false;
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset("mlp", 13);
        const auto params = trainable_parameters(*model);
        // fc0.weight is the last gradient backward reaches: throw there, after the later layers' buckets launched.
        const auto cut = test_support::cut_short_backward(comm, *model, ddp, *data, params);
        EXPECT_TRUE(cut.threw);
        own_aborted[comm.rank()] = cut.own_aborted;
        own_next[comm.rank()] = cut.own_next;
        launched[comm.rank()] = cut.launched;
        at::Tensor loss = ddp.loss(cut.next);  // settles the aborted backward first
        size_t done = 0;
        for (const auto& r : comm.recorder().since(cut.mark)) done += r.end_ns != 0 ? 1 : 0;
        completed[comm.rank()] = done;
        for (const auto& p : params) settled[comm.rank()].push_back(p.grad().clone());
        for (const auto& p : params) p.grad().zero_();  // the optimizer's zero_grad, once nothing writes there
        loss.backward();
        for (const auto& p : params) next[comm.rank()].push_back(p.grad().clone());
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    std::cout << "rank " << r << ": the aborted backward launched " << launched[r] << " buckets, " << completed[r]
              << " complete after the next forward\n";
    EXPECT_EQ(launched[r], 2u) << "the test needs buckets in flight when backward throws";
    EXPECT_EQ(completed[r], launched[r])
        << "every collective since the aborted backward must be complete after the next forward, and no more than "
        << "it launched: the forward waits for every bucket the aborted backward launched (wait_launched) and "
        << "launches nothing";
    // mlp parameters: 0 fc0.w, 1 fc0.b, 2 fc1.w, 3 fc1.b, 4 fc2.w, 5 fc2.b; the two launched buckets hold 2-5.
    for (size_t i = 2; i < 6; ++i) {
      const at::Tensor want = test_support::mean_of_two(own_aborted[0][i], own_aborted[1][i]);
      EXPECT_TRUE(at::equal(settled[r][i], want))
          << "rank " << r << " parameter " << i << ": after the settling forward .grad() is not the average (max diff "
          << test_support::max_diff(settled[r][i], want) << "; to the ranks' sum "
          << test_support::max_diff(settled[r][i], own_aborted[0][i] + own_aborted[1][i]) << ")";
    }
    for (size_t i = 0; i < next[r].size(); ++i) {
      const at::Tensor want = test_support::mean_of_two(own_next[0][i], own_next[1][i]);
      EXPECT_TRUE(at::equal(next[r][i], want))
          << "rank " << r << " parameter " << i << ": the next backward's gradient differs from the average by "
          << test_support::max_diff(next[r][i], want);
    }
  }
}

// The ranks' models are compared first thing in the constructor, before the checks a rank could fail alone: here
// rank 1 freezes every parameter ("no trainable parameter" on rank 1 only, while rank 0 would go on to its
// broadcasts). Every rank must throw the same error naming the first difference, after the check's all-gathers only.
// First equal models, which must construct.
TEST(BucketedDDP, ARankWhoseModelWouldFailALocalCheckIsStoppedOnEveryRankByTheComparison) {
  std::vector<test_support::Refusal> seen(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        BucketedDDP equal(make_model("mlp", 1 + comm.rank()), comm);
        auto model = make_model("mlp", 1);
        if (comm.rank() == 1)
          for (auto& p : model->parameters()) p.requires_grad_(false);
        seen[comm.rank()] = test_support::refusal_of(comm, [&] { BucketedDDP ddp(model, comm); });
      },
      test_group());
  test_support::expect_same_refusal(seen, {"frozen"});
}

// Hint 3 of task 4, and the contracts of finish_backward and wait_launched: wait for every bucket, also after one
// failed, because a collective still in flight writes into its bucket. The backend fails bucket 0's all-reduce on
// both ranks (without issuing it, so the rest still pair); the buckets after it must still be waited for, which is
// what leaves the exact average in them (Gloo has no AVG: the Communicator divides in wait()). First at the end of
// a backward (finish_backward), then for a backward cut short, in the next forward (wait_launched); the step after
// that averages as usual.
TEST(BucketedDDP, AFailedBucketDoesNotLeaveTheBucketsAfterItUnwaited) {
  std::vector<Watch> watches(2);
  std::vector<std::string> end_error(2), forward_error(2);
  std::vector<std::vector<at::Tensor>> own_end(2), own_cut(2), own_last(2), after_end(2), after_cut(2), last(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        const int rank = comm.rank();
        auto model = make_model("mlp", 14);
        Options options;
        options.caps = mlp_caps(3);  // [fc2.*] [fc1.*] [fc0.*]
        options.rebuild_buckets = false;
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset("mlp", 14);
        const auto params = trainable_parameters(*model);
        Watch& watch = watches[rank];
        auto fail_next_all_reduce = [&] {
          std::lock_guard<std::mutex> lock(watch.mu);
          watch.fail_at = watch.all_reduces;
        };
        auto grads = [&] {
          std::vector<at::Tensor> g;
          for (const auto& p : params) g.push_back(p.grad().clone());
          return g;
        };
        // 1. The end of a backward: bucket 0 fails; buckets 1 and 2 were launched too.
        const Batch first = rank_slice(data->global_batch(0, 8), rank, 2);
        own_end[rank] = test_support::local_gradients(*model, first, params);
        at::Tensor loss = ddp.loss(first);
        fail_next_all_reduce();
        try {
          loss.backward();
        } catch (const std::exception& e) {
          end_error[rank] = e.what();
        }
        after_end[rank] = grads();
        // 2. A backward cut short at fc0.weight, after buckets 0 and 1 were launched; bucket 0 fails. The next
        // forward waits for both, and reports the failure.
        const Batch second = rank_slice(data->global_batch(1, 8), rank, 2);
        const Batch third = rank_slice(data->global_batch(2, 8), rank, 2);
        own_cut[rank] = test_support::local_gradients(*model, second, params);
        own_last[rank] = test_support::local_gradients(*model, third, params);
        loss = ddp.loss(second);
        for (const auto& p : params) p.grad().zero_();
        fail_next_all_reduce();
        EXPECT_TRUE(test_support::backward_cut_short_at(params.front(), [&] { loss.backward(); }));
        try {
          loss = ddp.loss(third);
        } catch (const std::exception& e) {
          forward_error[rank] = e.what();
        }
        after_cut[rank] = grads();
        // 3. The next step starts clean.
        loss = ddp.loss(third);
        for (const auto& p : params) p.grad().zero_();
        loss.backward();
        last[rank] = grads();
      },
      watched_group(watches));
  // mlp parameters: 0 fc0.w, 1 fc0.b, 2 fc1.w, 3 fc1.b, 4 fc2.w, 5 fc2.b; bucket 0 (the failed one) holds 4 and 5.
  auto expect_averaged = [&](const std::vector<std::vector<at::Tensor>>& got,
                             const std::vector<std::vector<at::Tensor>>& own, std::vector<size_t> which,
                             const char* when) {
    for (int r = 0; r < 2; ++r)
      for (size_t i : which) {
        const at::Tensor want = test_support::mean_of_two(own[0][i], own[1][i]);
        EXPECT_TRUE(at::equal(got[r][i], want))
            << when << ", rank " << r << " parameter " << i << ": .grad() is not the average (max diff "
            << test_support::max_diff(got[r][i], want) << "; to the ranks' sum, what an all-reduce never waited for "
            << "leaves: " << test_support::max_diff(got[r][i], own[0][i] + own[1][i]) << "): every bucket launched "
            << "must be waited for, also after an earlier one failed (wait_all), before the error comes out";
      }
  };
  for (int r = 0; r < 2; ++r) {
    std::cout << "rank " << r << ": backward: " << end_error[r].substr(0, 100)
              << "\n        next forward: " << forward_error[r].substr(0, 100) << "\n";
    EXPECT_NE(end_error[r].find("injected failure"), std::string::npos)
        << "rank " << r << ": the failed bucket's error comes out of backward; got: " << end_error[r];
    EXPECT_NE(forward_error[r].find("injected failure"), std::string::npos)
        << "rank " << r
        << ": the forward after a backward cut short reports its failed bucket; got: " << forward_error[r];
  }
  expect_averaged(after_end, own_end, {0, 1, 2, 3}, "after a backward whose bucket 0 failed (finish_backward)");
  // cut short: buckets 0 (failed) and 1 (fc1) were launched, bucket 2 (fc0) never
  expect_averaged(after_cut, own_cut, {2, 3}, "after the forward that settled a backward cut short (wait_launched)");
  expect_averaged(last, own_last, {0, 1, 2, 3, 4, 5}, "the step after");
}

}  // namespace
}  // namespace shardlab::bucketed_ddp
