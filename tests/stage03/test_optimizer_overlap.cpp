// Stage 03 — the optimizer overlapped with communication. Stepping each bucket's parameters as soon as the bucket's
// average lands must give exactly what one optimizer step after backward gives (bit for bit: the same arithmetic
// per parameter), step buckets in bucket order, each after its reduction, and only on the synchronized backward.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/comm_hooks/optimizer_overlap.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/device.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/param_name.h"
#include "support/rank_zero_first.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/lbfgs.h>

#include <atomic>
#include <iostream>
#include <set>

namespace shardlab::comm_hooks {
namespace {

using bucketed_ddp::BucketedDDP;
using bucketed_ddp::Options;
using test_support::test_group;

struct OverlapCase {
  std::string model, optimizer, hook;  // hook "": the plain average
  int world, micro;
};

std::ostream& operator<<(std::ostream& os, const OverlapCase& c) {
  return os << c.model << "_" << c.optimizer << (c.hook.empty() ? "" : "_" + c.hook) << "_w" << c.world << "_m"
            << c.micro;
}

TrainConfig config_of(const OverlapCase& o) {
  // 4 steps: step 1 rebuilds the buckets, and the overlap must survive a new layout
  TrainConfig c = test_support::equivalence_config(o.model, o.optimizer, o.micro).steps(4).global_batch(12).seed(21);
  return c;
}

// One rank's training with the optimizer inside backward: no optimizer step after it, gradients zeroed before
// each step's first micro-batch, the first micro-batches inside no_sync.
std::vector<at::Tensor> train_overlapped(Communicator& comm, const TrainConfig& c, const std::string& hook,
                                         size_t* buckets, size_t* bucket_steps) {
  auto model = make_model(c, device_of(c));
  const auto params = trainable_parameters(*model);
  auto overlapped = std::make_shared<OverlappedOptimizer>(
      params, [&](std::vector<at::Tensor> p) { return make_optimizer(c.optimizer, std::move(p), c.lr); });
  Options options;
  options.caps = {2048, 8192};
  options.reducer = hook_then_optimizer(hook.empty() ? nullptr : as_bucket_reducer(make_hook(hook, comm)), overlapped);
  BucketedDDP ddp(model, comm, options);
  auto data = make_dataset(c.model, c.seed);
  for (int step = 0; step < c.steps; ++step) {
    overlapped->zero_grad();
    auto micro =
        micro_batches(rank_slice(data->global_batch(step, c.global_batch), comm.rank(), comm.size()).to(device_of(c)),
                      c.micro_batches);
    for (int i = 0; i < c.micro_batches; ++i) {
      const size_t logged = overlapped->log().size();
      if (i + 1 < c.micro_batches) {
        auto scope = ddp.no_sync();
        (ddp.loss(micro[i]) / c.micro_batches).backward();
        EXPECT_EQ(overlapped->log().size(), logged) << "a backward inside no_sync must step nothing";
      } else {
        (ddp.loss(micro[i]) / c.micro_batches).backward();
        EXPECT_EQ(overlapped->log().size() - logged, ddp.buckets().size()) << "one step per bucket";
      }
    }
  }
  *buckets = ddp.buckets().size();
  *bucket_steps = overlapped->log().size();
  std::vector<at::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().cpu().clone());
  return out;
}

// The same training with one optimizer step after backward (the hook, if any, without the overlap).
std::vector<at::Tensor> train_plain(Communicator& comm, const TrainConfig& c, const std::string& hook) {
  auto model = make_model(c, device_of(c));
  Options options;
  options.caps = {2048, 8192};
  if (!hook.empty()) options.reducer = as_bucket_reducer(make_hook(hook, comm));
  BucketedDDP ddp(model, comm, options);
  return test_support::train_replica(comm, c, *model, ddp);
}

class OptimizerOverlap : public ::testing::TestWithParam<OverlapCase> {};

TEST_P(OptimizerOverlap, MatchesOneStepAfterBackwardBitForBit) {
  const OverlapCase& o = GetParam();
  const TrainConfig c = config_of(o);
  std::vector<std::vector<at::Tensor>> overlapped(o.world), plain(o.world);
  std::vector<size_t> buckets(o.world), steps(o.world);
  run_ranks(
      o.world,
      [&](Communicator& comm) {
        overlapped[comm.rank()] = train_overlapped(comm, c, o.hook, &buckets[comm.rank()], &steps[comm.rank()]);
        plain[comm.rank()] = train_plain(comm, c, o.hook);
      },
      test_group());
  const ReferenceResult ref = train_reference(c);
  for (int r = 0; r < o.world; ++r) {
    const double diff = max_abs_diff(overlapped[r], plain[r]);
    std::cout << o << " rank " << r << ": " << buckets[r] << " buckets, " << steps[r]
              << " bucket steps; max |overlapped - plain step| = " << diff
              << ", max |overlapped - one device| = " << max_abs_diff(overlapped[r], ref.params) << "\n";
    ASSERT_EQ(overlapped[r].size(), plain[r].size());
    for (size_t i = 0; i < plain[r].size(); ++i)
      EXPECT_TRUE(at::equal(overlapped[r][i], plain[r][i]))
          << "rank " << r << " parameter " << i << " differs by "
          << (overlapped[r][i] - plain[r][i]).abs().max().item<double>();
    if (o.hook.empty()) EXPECT_TRUE(all_close(overlapped[r], ref.params, 1e-5, 1e-6)) << "and both match one device";
    EXPECT_GT(buckets[r], 1u) << "the test needs several buckets";
  }
}

INSTANTIATE_TEST_SUITE_P(Stage03, OptimizerOverlap,
                         ::testing::Values(OverlapCase{"tiny_gpt", "sgd", "", 2, 1},
                                           OverlapCase{"mlp", "adamw", "", 3, 2},
                                           OverlapCase{"tiny_gpt", "sgd", "", 2, 3},
                                           OverlapCase{"tiny_gpt", "adamw", "allreduce", 2, 2},
                                           OverlapCase{"mlp", "sgd", "fp16", 2, 1}),
                         test_support::StreamedName());

// One rank's BucketedDDP over model `name` of seed `seed` with bucket caps `caps`, every bucket averaged and then
// stepped at once by SGD at lr 0.05 over its parameters (hook_then_optimizer), and the dataset of that seed.
struct SgdInBackward {
  SgdInBackward(Communicator& comm, const std::string& name, uint64_t seed, const bucketed_ddp::BucketCaps& caps)
      : model(make_model(name, seed)),
        params(trainable_parameters(*model)),
        overlapped(std::make_shared<OverlappedOptimizer>(
            params, [](std::vector<at::Tensor> p) { return make_optimizer("sgd", std::move(p), 0.05); })),
        ddp(model, comm, options(caps, overlapped)),
        data(make_dataset(name, seed)) {}

  // BucketedDDP's options with `caps`, each bucket stepped by `overlapped` once averaged.
  static Options options(const bucketed_ddp::BucketCaps& caps, std::shared_ptr<OverlappedOptimizer> overlapped) {
    Options out;
    out.caps = caps;
    out.reducer = hook_then_optimizer(nullptr, std::move(overlapped));
    return out;
  }

  std::shared_ptr<Model> model;
  std::vector<at::Tensor> params;
  std::shared_ptr<OverlappedOptimizer> overlapped;
  BucketedDDP ddp;
  std::unique_ptr<Dataset> data;
};

// Order: per synchronized backward one step per bucket, in bucket order, each stepping exactly its bucket's
// parameters and starting after that bucket's all-reduce completed (the record's end is stamped before the
// continuation runs).
TEST(OptimizerOverlapOrder, EachBucketIsSteppedAfterItsReductionInBucketOrder) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        SgdInBackward o(comm, "tiny_gpt", 8, {2048, 8192});
        for (int step = 0; step < 3; ++step) {
          o.overlapped->zero_grad();
          const size_t logged = o.overlapped->log().size();
          at::Tensor loss = o.ddp.loss(rank_slice(o.data->global_batch(step, 8), comm.rank(), 2));
          const size_t mark = comm.recorder().size();
          loss.backward();
          const auto recs = comm.recorder().since(mark);
          const auto& buckets = o.ddp.buckets();
          ASSERT_EQ(recs.size(), buckets.size());
          ASSERT_EQ(o.overlapped->log().size() - logged, buckets.size()) << "step " << step;
          for (size_t b = 0; b < buckets.size(); ++b) {
            EXPECT_EQ(recs[b].op + " " + recs[b].reduce, "all_reduce avg")
                << "bucket " << b << ": without a reducer, hook_then_optimizer averages the bucket as BucketedDDP "
                << "does (all_reduce with AVG)";
            const auto& entry = o.overlapped->log()[logged + b];
            EXPECT_EQ(std::set<size_t>(entry.params.begin(), entry.params.end()),
                      std::set<size_t>(buckets[b].params.begin(), buckets[b].params.end()))
                << "step " << step << ": the " << b << "th optimizer step is bucket " << b << "'s";
            EXPECT_GE(entry.start_ns, recs[b].end_ns) << "bucket " << b << " stepped before its reduction landed";
            if (b > 0) EXPECT_GE(entry.start_ns, o.overlapped->log()[logged + b - 1].end_ns) << "bucket order";
          }
          if (comm.rank() == 0)
            std::cout << "step " << step << ": " << buckets.size() << " buckets, each stepped after its all-reduce, "
                      << "in bucket order\n";
        }
      },
      test_group());
}

// A backward that fails (the edge model's `sometimes` has no gradient on odd steps, and find_unused_parameters is
// off) or is cut short (an exception in backward) must step nothing, although its buckets are still waited for.
TEST(OptimizerOverlapOrder, NothingIsSteppedWhenBackwardFailsOrIsCutShort) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        SgdInBackward o(comm, "edge", 14, {64, 128});
        auto snapshot = [&] {
          std::vector<at::Tensor> out;
          for (const auto& p : o.params) out.push_back(p.detach().clone());
          return out;
        };
        auto unchanged = [&](const std::vector<at::Tensor>& before) {
          for (size_t i = 0; i < o.params.size(); ++i)
            if (!at::equal(o.params[i], before[i])) return false;
          return true;
        };
        // Step 0 (even): complete, every bucket stepped.
        o.overlapped->zero_grad();
        o.ddp.loss(rank_slice(o.data->global_batch(0, 8), comm.rank(), 2)).backward();
        const size_t after_complete = o.overlapped->log().size();
        EXPECT_GT(after_complete, 0u);
        // Step 1 (odd): `sometimes` gets no gradient, backward throws; nothing may move.
        std::vector<at::Tensor> before = snapshot();
        o.overlapped->zero_grad();
        EXPECT_THROW(o.ddp.loss(rank_slice(o.data->global_batch(1, 8), comm.rank(), 2)).backward(), std::runtime_error);
        EXPECT_EQ(o.overlapped->log().size(), after_complete) << "a failed backward stepped a bucket";
        EXPECT_TRUE(unchanged(before)) << "a failed backward changed parameters";
        // Step 2 (even), cut short by an exception in backward: the next forward settles it without stepping.
        // Cut at trunk.weight, the last gradient backward reaches, so that buckets are in flight when it throws.
        ASSERT_EQ(o.ddp.parameter_names()[1], "trunk.weight");
        o.overlapped->zero_grad();
        const size_t mark = comm.recorder().size();
        EXPECT_TRUE(test_support::backward_cut_short_at(
            o.params[1], [&] { o.ddp.loss(rank_slice(o.data->global_batch(2, 8), comm.rank(), 2)).backward(); }));
        EXPECT_GT(comm.recorder().size(), mark) << "the test needs buckets in flight when backward throws";
        at::Tensor loss = o.ddp.loss(rank_slice(o.data->global_batch(2, 8), comm.rank(), 2));  // settles
        EXPECT_EQ(o.overlapped->log().size(), after_complete) << "a backward cut short stepped a bucket";
        EXPECT_TRUE(unchanged(before)) << "a backward cut short changed parameters";
        o.overlapped->zero_grad();
        loss.backward();
        EXPECT_GT(o.overlapped->log().size(), after_complete) << "the next complete backward steps again";
        EXPECT_FALSE(unchanged(before));
        if (comm.rank() == 0)
          std::cout << "complete backward: " << after_complete << " bucket steps; failed and cut-short backwards: 0; "
                    << "next complete: " << o.overlapped->log().size() - after_complete << "\n";
      },
      test_group());
}

// The reducer starts the reduction and returns on the backward thread: rank 0 calls it while rank 1 waits for it to
// return (30 s at most) before calling its own, so the reduction cannot have landed yet. Waited for outside
// BucketedDDP's end of backward, its handle steps nothing (optimizer_overlap.h).
TEST(OptimizerOverlapOrder, TheReducerReturnsBeforeItsReductionLandsAndStepsNothingOutsideBackward) {
  std::atomic<bool> returned{false};
  run_ranks(
      2,
      [&](Communicator& comm) {
        const std::vector<at::Tensor> params{at::zeros({4}, at::requires_grad())};
        auto overlapped = std::make_shared<OverlappedOptimizer>(
            params, [](std::vector<at::Tensor> p) { return make_optimizer("sgd", std::move(p), 0.1); });
        const bucketed_ddp::BucketReducer reducer = hook_then_optimizer(nullptr, overlapped);
        at::Tensor bucket = at::full({4}, comm.rank() + 1.0f);
        Handle h;
        test_support::rank_zero_first(comm, returned,
                                      "rank 0's call of the reducer had not returned 30 s later, while rank 1 had not "
                                      "called its own: the reducer must start the reduction and return, the step "
                                      "belongs in the handle's continuation",
                                      [&] { h = reducer(comm, bucket); });
        h.wait();
        EXPECT_TRUE(bucket.eq(1.5f).all().item<bool>()) << "the bucket's average: " << bucket;
        EXPECT_TRUE(overlapped->log().empty())
            << "waited for outside BucketedDDP's end of backward, the handle stepped " << overlapped->log().size()
            << " bucket(s); expected none";
      },
      test_group());
}

TEST(OptimizerOverlapOrder, RefusesWhatCannotBeSteppedBucketByBucket) {
  const std::vector<at::Tensor> params{at::zeros({4}, at::requires_grad()), at::zeros({2}, at::requires_grad())};
  auto sgd = [](std::vector<at::Tensor> p) { return make_optimizer("sgd", std::move(p), 0.1); };
  auto expect_refusal = [](const std::function<void()>& make, const std::string& words) {
    try {
      make();
      ADD_FAILURE() << "expected a refusal mentioning '" << words << "'";
    } catch (const std::invalid_argument& e) {
      std::cout << "refused: " << e.what() << "\n";
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_refusal(
      [&] {
        OverlappedOptimizer(
            params, [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::LBFGS>(std::move(p)); });
      },
      "LBFGS");
  expect_refusal([&] { OverlappedOptimizer(params, sgd, /*max_grad_norm=*/1.0); }, "global gradient norm");
  expect_refusal([&] { OverlappedOptimizer({}, sgd); }, "got none");
  expect_refusal([&] { hook_then_optimizer(nullptr, nullptr); }, "null");
  OverlappedOptimizer ok(params, sgd);
  EXPECT_EQ(ok.size(), 2u);
  expect_refusal([&] { ok.step_bucket(at::zeros({6})); }, "no parameter's gradient");
}

}  // namespace
}  // namespace shardlab::comm_hooks
