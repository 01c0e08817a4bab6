// Stage 02 — the buckets and their layout: assign_buckets' cuts (task 1), every gradient a view into its bucket's
// slice of the flat buffer (task 3), and the buckets rebuilt from the real gradient-ready order (the ranks agreeing
// on rank 0's order, task 2, through what a user sees; agree_on_order itself: test_bucketed_ddp_seams.cpp).
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "stage02/bucketed_ddp_support.h"
#include "support/device.h"
#include "support/group.h"
#include "support/watched_backend.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <iostream>
#include <numeric>
#include <string>

namespace shardlab::bucketed_ddp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

TEST(AssignBuckets, CapsDecideTheCutsAndTheFirstBucketIsSmall) {
  auto model = make_model("mlp", 1);
  const auto params = trainable_parameters(*model);
  std::vector<size_t> reverse(params.size());
  std::iota(reverse.rbegin(), reverse.rend(), size_t{0});
  using Plan = std::vector<std::vector<size_t>>;
  // params: 0 fc0.w, 1 fc0.b, 2 fc1.w, 3 fc1.b, 4 fc2.w, 5 fc2.b
  EXPECT_EQ(assign_buckets(params, reverse, mlp_caps(1)), (Plan{{5, 4, 3, 2, 1, 0}}));
  EXPECT_EQ(assign_buckets(params, reverse, mlp_caps(2)), (Plan{{5, 4}, {3, 2, 1, 0}}));
  EXPECT_EQ(assign_buckets(params, reverse, mlp_caps(3)), (Plan{{5, 4}, {3, 2}, {1, 0}}));
  // a bucket closes as soon as it reaches its cap: exactly 1040 bytes closes the first one at fc2.weight
  EXPECT_EQ(assign_buckets(params, reverse, {1040, 1 << 20}), (Plan{{5, 4}, {3, 2, 1, 0}}));
  EXPECT_EQ(assign_buckets(params, reverse, {1041, 1 << 20}), (Plan{{5, 4, 3}, {2, 1, 0}}));
  // a parameter larger than the cap gets a bucket of its own
  EXPECT_EQ(assign_buckets(params, reverse, {1, 1}).size(), params.size());
}

TEST(AssignBuckets, DtypesNeverShareABucket) {
  std::vector<at::Tensor> params{at::zeros({4}), at::zeros({4}, at::kDouble), at::zeros({4}),
                                 at::zeros({4}, at::kDouble)};
  const auto plan = assign_buckets(params, {0, 1, 2, 3}, {1 << 20, 1 << 20});
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0], (std::vector<size_t>{0, 2}));
  EXPECT_EQ(plan[1], (std::vector<size_t>{1, 3}));
}

// The small first cap applies to the first bucket of EACH dtype (bucket_plan.h), not only to the first bucket of all.
TEST(AssignBuckets, EveryDtypesFirstBucketHasTheSmallCap) {
  // float 16 B, double 32 B, float 16 B, double 32 B, float 16 B, double 32 B
  std::vector<at::Tensor> params{at::zeros({4}), at::zeros({4}, at::kDouble),
                                 at::zeros({4}), at::zeros({4}, at::kDouble),
                                 at::zeros({4}), at::zeros({4}, at::kDouble)};
  const auto plan = assign_buckets(params, {0, 1, 2, 3, 4, 5}, {16, 1 << 20});
  // each dtype: its first parameter fills its small first bucket; the rest share a large one
  const std::vector<std::vector<size_t>> want{{0}, {1}, {2, 4}, {3, 5}};
  EXPECT_EQ(plan, want) << "caps first 16 B, then 1 MiB: the double parameters' first bucket must close at 16 B too "
                        << "(each dtype's first bucket has the small cap), giving {1} and {3, 5}, not {1, 3, 5}";
}

TEST(AssignBuckets, RejectsBadOrdersAndCaps) {
  std::vector<at::Tensor> params{at::zeros({4}), at::zeros({4})};
  EXPECT_EQ(assign_buckets(params, {1, 0}, {}), (std::vector<std::vector<size_t>>{{1, 0}})) << "a valid call works";
  EXPECT_THROW(assign_buckets(params, {0}, {}), std::invalid_argument);
  EXPECT_THROW(assign_buckets(params, {0, 0}, {}), std::invalid_argument);
  EXPECT_THROW(assign_buckets(params, {0, 2}, {}), std::invalid_argument);
  try {
    assign_buckets(params, {0, 1}, {0, 1});
    ADD_FAILURE() << "a zero cap must be rejected";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("positive"), std::string::npos) << e.what();
  }
}

// Task 3: the layout at construction. Every trainable parameter's .grad() is its slot in the flat buffer of its
// dtype (same storage, at the offset its bucket and its place in the bucket give), the bucket slices tile the
// buffer in launch order, the buffer lives on the parameters' device, and a gradient that existed before keeps its
// values. No backward runs here: this needs only tasks 1 and 3.
TEST(BucketedDDP, LayoutGivesEveryGradientItsSlotInItsBucketsSlice) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("tiny_gpt", 6, test_support::device());
        const auto params = trainable_parameters(*model);
        params[1].mutable_grad() = at::full_like(params[1], 0.25);  // a gradient from before the wrap
        BucketedDDP ddp(model, comm, test_support::with_caps(test_support::gpt_caps()));
        ASSERT_GT(ddp.buckets().size(), 2u);
        const at::Tensor buffer = ddp.grad_buffer(at::kFloat);
        ASSERT_TRUE(buffer.defined());
        EXPECT_EQ(buffer.device(), params[0].device()) << "the buffer lives on the parameters' device";
        int64_t offset = 0;
        std::vector<int> seen(ddp.parameters().size(), 0);
        for (const auto& b : ddp.buckets()) {
          EXPECT_EQ(b.offset, offset) << "buckets tile the buffer in launch order";
          EXPECT_EQ(b.flat.data_ptr(), static_cast<char*>(buffer.data_ptr()) + offset * 4);
          EXPECT_EQ(b.flat.numel(), b.numel);
          int64_t at = b.offset;
          for (size_t i : b.params) {
            const at::Tensor g = ddp.parameters()[i].grad();
            ASSERT_TRUE(g.defined()) << ddp.parameter_names()[i];
            EXPECT_EQ(g.data_ptr(), static_cast<char*>(buffer.data_ptr()) + at * 4) << ddp.parameter_names()[i];
            EXPECT_EQ(g.sizes(), ddp.parameters()[i].sizes());
            EXPECT_FALSE(g.is_view()) << "an autograd view cannot be detached in place by zero_grad";
            at += ddp.parameters()[i].numel();
            ++seen[i];
          }
          offset += b.numel;
        }
        EXPECT_EQ(offset, buffer.numel());
        for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << ddp.parameter_names()[i];
        EXPECT_EQ(params[1].grad().min().item<float>(), 0.25f) << "an existing gradient keeps its values";
        EXPECT_EQ(params[1].grad().max().item<float>(), 0.25f);
        EXPECT_EQ(buffer.abs().sum().item<double>(), 0.25 * params[1].numel()) << "the rest starts at zero";
        if (comm.rank() == 0)
          std::cout << ddp.buckets().size() << " buckets tile a buffer of " << buffer.numel() << " floats on "
                    << buffer.device() << "\n";
      },
      test_group());
}

// A model whose registration order differs from its use order: registered a, b, c; used c -> a -> b (or, with
// `other`, a -> c -> b). Backward makes b's gradients ready first, then a's, then c's (or c's, then a's) — not the
// reverse of registration (c, b, a).
class Shuffled : public Model {
 public:
  explicit Shuffled(bool other) : other_(other) {
    a_ = register_module("a", torch::nn::Linear(8, 8));
    b_ = register_module("b", torch::nn::Linear(8, 8));
    c_ = register_module("c", torch::nn::Linear(8, 8));
  }
  at::Tensor loss(const Batch& batch) override {
    auto& first = other_ ? a_ : c_;
    auto& second = other_ ? c_ : a_;
    at::Tensor h = b_->forward(at::relu(second->forward(at::relu(first->forward(batch.input)))));
    return at::nll_loss(at::log_softmax(h, -1), batch.target);
  }

 private:
  bool other_;
  torch::nn::Linear a_{nullptr}, b_{nullptr}, c_{nullptr};
};

TEST(BucketedDDP, RebuildFollowsTheGradientReadyOrderOnEveryRank) {
  const int world = 3;
  std::vector<std::vector<size_t>> initial(world), ready(world), rebuilt(world);
  std::vector<std::vector<std::string>> names(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        // Rank 0 uses the layers in one order, the others in another: their ready orders differ, and every rank
        // must still adopt rank 0's.
        auto model = std::make_shared<Shuffled>(/*other=*/comm.rank() != 0);
        Options options;
        options.caps = {200, 300};  // weight 256 B, bias 32 B: several buckets
        BucketedDDP ddp(model, comm, options);
        for (const auto& b : ddp.buckets())
          initial[comm.rank()].insert(initial[comm.rank()].end(), b.params.begin(), b.params.end());
        Batch batch{at::linspace(-1, 1, 32).view({4, 8}), at::arange(4, at::kLong), 0};
        ddp.loss(batch).backward();
        ready[comm.rank()] = ddp.ready_order();
        EXPECT_FALSE(ddp.rebuilt());
        ddp.loss(batch).backward();  // the forward rebuilds
        EXPECT_TRUE(ddp.rebuilt());
        for (const auto& b : ddp.buckets())
          rebuilt[comm.rank()].insert(rebuilt[comm.rank()].end(), b.params.begin(), b.params.end());
        names[comm.rank()] = ddp.parameter_names();
      },
      test_group());
  auto show = [&](const std::vector<size_t>& order) {
    std::string s;
    for (size_t i : order) s += names[0][i] + " ";
    return s;
  };
  std::cout << "initial layout:       " << show(initial[0]) << "\nready order, rank 0:  " << show(ready[0])
            << "\nready order, rank 1:  " << show(ready[1]) << "\nrebuilt layout:       " << show(rebuilt[0]) << "\n";
  EXPECT_NE(initial[0], ready[0]) << "the test model must make the ready order differ from registration";
  EXPECT_NE(ready[1], ready[0]) << "the test must give rank 1 another ready order than rank 0";
  for (int r = 0; r < world; ++r)
    EXPECT_EQ(rebuilt[r], ready[0]) << "rank " << r << " lays its buckets out in rank 0's ready order";
  // b's parameters (indices 2, 3) are ready before a's (0, 1), before c's (4, 5)
  auto pos = [&](size_t i) { return std::find(ready[0].begin(), ready[0].end(), i) - ready[0].begin(); };
  EXPECT_LT(std::max(pos(2), pos(3)), std::min(pos(0), pos(1)));
  EXPECT_LT(std::max(pos(0), pos(1)), std::min(pos(4), pos(5)));
}

TEST(BucketedDDP, GradientsAreViewsIntoTheFlatBuffer) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        test_support::GptUnderDdp gpt(comm, 5);
        const at::Tensor buffer = gpt.ddp.grad_buffer(at::kFloat);
        ASSERT_TRUE(buffer.defined());
        auto check = [&](const char* when) {
          const at::Tensor buf = gpt.ddp.grad_buffer(at::kFloat);
          const auto* begin = static_cast<const char*>(buf.data_ptr());
          const auto* end = begin + buf.numel() * buf.element_size();
          for (size_t i = 0; i < gpt.ddp.parameters().size(); ++i) {
            const at::Tensor g = gpt.ddp.parameters()[i].grad();
            ASSERT_TRUE(g.defined()) << when << ": " << gpt.ddp.parameter_names()[i];
            EXPECT_TRUE(g.is_alias_of(buf)) << when << ": " << gpt.ddp.parameter_names()[i];
            const auto* p = static_cast<const char*>(g.data_ptr());
            EXPECT_TRUE(p >= begin && p + g.numel() * g.element_size() <= end) << when;
          }
        };
        check("after construction");
        for (int step = 0; step < 3; ++step) {
          compat::zero_grad(*gpt.opt);
          gpt.ddp.loss(rank_slice(gpt.data->global_batch(step, 4), comm.rank(), 2)).backward();
          check("after backward");
          // layout: bucket b's slice is exactly its parameters' gradients, in bucket order (same memory)
          for (const auto& b : gpt.ddp.buckets()) {
            int64_t at = 0;
            for (size_t i : b.params) {
              const at::Tensor g = gpt.ddp.parameters()[i].grad();
              EXPECT_TRUE(at::equal(b.flat.narrow(0, at, g.numel()), g.reshape({-1})));
              at += g.numel();
            }
          }
          gpt.opt->step();
        }
        // Something drops a .grad (libtorch 2.x zero_grad sets them to None): the next forward re-attaches a view.
        const std::vector<at::Tensor> params = gpt.ddp.parameters();
        params[0].mutable_grad() = at::Tensor();
        params[1].mutable_grad() = at::ones_like(params[1]);
        gpt.ddp.loss(rank_slice(gpt.data->global_batch(3, 4), comm.rank(), 2));
        check("after a .grad was dropped and another replaced");
        EXPECT_EQ(gpt.ddp.parameters()[0].grad().abs().sum().item<double>(), 0.0)
            << "a dropped grad comes back as zeros";
        EXPECT_EQ(gpt.ddp.parameters()[1].grad().sum().item<double>(),
                  static_cast<double>(gpt.ddp.parameters()[1].numel()))
            << "a replaced grad keeps its value";
      },
      test_group());
}

// A forward without grad (evaluation) on one rank only must not issue the rebuild's broadcast.
TEST(BucketedDDP, EvaluationForwardOnOneRankRunsNoCollective) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 3);
        BucketedDDP ddp(model, comm);
        auto data = make_dataset("mlp", 3);
        ddp.loss(rank_slice(data->global_batch(0, 8), comm.rank(), 2)).backward();  // a rebuild is now pending
        const size_t mark = comm.recorder().size();
        if (comm.rank() == 0) {
          at::NoGradGuard no_grad;
          ddp.loss(data->global_batch(1, 8));
        }
        EXPECT_EQ(comm.recorder().size(), mark) << "no collective in an evaluation forward";
        EXPECT_FALSE(ddp.rebuilt());
        ddp.loss(rank_slice(data->global_batch(2, 8), comm.rank(), 2)).backward();  // the rebuild happens here
        EXPECT_TRUE(ddp.rebuilt());
      },
      test_group());
}

TEST(BucketedDDP, RejectsNonPositiveCaps) {
  run_ranks(
      1,
      [&](Communicator& comm) {
        EXPECT_EQ(BucketedDDP(make_model("mlp", 1), comm, Options{}).buckets().size(), 1u) << "default caps work";
        Options options;
        options.caps.bytes = 0;
        EXPECT_THROW(BucketedDDP(make_model("mlp", 1), comm, options), std::invalid_argument);
      },
      test_group());
}

}  // namespace
}  // namespace shardlab::bucketed_ddp
