// Stage 02 — bucketed DDP. N ranks (threads, real Gloo) must train exactly like one device, with one all-reduce
// per bucket, the first of them started while backward is still running, and buckets rebuilt from the real
// gradient-ready order.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/bucketed_ddp/order_agreement.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/clipping.h"
#include "support/device.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/no_sync.h"
#include "support/refusal.h"
#include "support/train_replica.h"
#include "support/watched_backend.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <iostream>
#include <mutex>
#include <numeric>
#include <sstream>

namespace shardlab::bucketed_ddp {
namespace {

using test_support::test_group;
using test_support::Watch;
using test_support::watched_group;

constexpr double kRtol = 1e-5, kAtol = 1e-6;

// The mlp's trainable parameters in reverse registration order (bytes): fc2.bias 16, fc2.weight 1024,
// fc1.bias 256, fc1.weight 16384, fc0.bias 256, fc0.weight 4096. These caps cut that list into 1, 2 or 3 buckets.
BucketCaps mlp_caps(int buckets) {
  if (buckets == 1) return {};               // 1 MiB first bucket holds everything
  if (buckets == 2) return {1000, 1 << 20};  // [fc2.*] [the rest]
  return {1000, 16000};                      // [fc2.*] [fc1.*] [fc0.*]
}

std::vector<at::Tensor> train_rank(Communicator& comm, const TrainConfig& c, const Options& options,
                                   size_t* buckets = nullptr) {
  auto model = make_model(c.model, c.seed, device_of(c));
  BucketedDDP ddp(model, comm, options);
  auto params = test_support::train_replica(comm, c, *model, ddp);
  if (buckets) *buckets = ddp.buckets().size();
  return params;
}

struct EquivalenceCase {
  std::string model, optimizer;
  int world, micro, buckets;  // buckets: 1-3 force that many with mlp_caps; 0 = small caps (several buckets)
  bool find_unused;
};

std::ostream& operator<<(std::ostream& os, const EquivalenceCase& e) {
  return os << e.model << "_" << e.optimizer << "_w" << e.world << "_m" << e.micro << "_b" << e.buckets
            << (e.find_unused ? "_unused" : "");
}

class Equivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(Equivalence, MatchesSingleDeviceReference) {
  const auto& e = GetParam();
  TrainConfig c;
  c.model = e.model;
  c.optimizer = e.optimizer;
  c.lr = e.optimizer == "adamw" ? 1e-2 : 0.05;
  c.steps = 5;  // step 1 rebuilds the buckets: later steps run on the rebuilt layout
  c.global_batch = 12;
  c.micro_batches = e.micro;
  c.seed = 11;
  c.device = test_support::device_name();
  Options options;
  options.caps = e.buckets > 0 ? mlp_caps(e.buckets) : e.model == "edge" ? BucketCaps{64, 128} : BucketCaps{2048, 8192};
  options.find_unused_parameters = e.find_unused;
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> finals(e.world);
  std::vector<size_t> buckets(e.world);
  run_ranks(
      e.world, [&](Communicator& comm) { finals[comm.rank()] = train_rank(comm, c, options, &buckets[comm.rank()]); },
      test_group());
  for (int r = 0; r < e.world; ++r) {
    const double diff = max_abs_diff(finals[r], ref.params);
    std::cout << e << " rank " << r << ": " << buckets[r] << " buckets, max |param - reference| = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << "rank " << r << " max diff " << diff;
    if (e.model == "mlp" && e.buckets > 0) EXPECT_EQ(buckets[r], static_cast<size_t>(e.buckets));
  }
}

std::vector<EquivalenceCase> equivalence_cases() {
  std::vector<EquivalenceCase> cases;
  for (int b : {1, 2, 3}) {
    cases.push_back({"mlp", "sgd", 2, 1, b, false});
    cases.push_back({"mlp", "adamw", 3, 1, b, false});
  }
  cases.push_back({"mlp", "sgd", 4, 3, 3, false});  // gradient accumulation with no_sync
  cases.push_back({"mlp", "adamw", 2, 2, 2, false});
  // tiny GPT (SGD: see Note [Comparing with one device] in common/course/src/reference.cpp) with many small buckets
  cases.push_back({"tiny_gpt", "sgd", 2, 1, 0, false});
  cases.push_back({"tiny_gpt", "sgd", 4, 3, 0, false});
  cases.push_back({"tiny_gpt", "sgd", 3, 1, 1, false});
  // edge: `sometimes` gets no gradient on odd steps, reduced as a zero gradient
  cases.push_back({"edge", "sgd", 2, 1, 0, true});
  cases.push_back({"edge", "adamw", 3, 2, 0, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stage02, Equivalence, ::testing::ValuesIn(equivalence_cases()), [](const auto& info) {
  std::ostringstream s;
  s << info.param;
  return s.str();
});

// World size 1 on NCCL (one GPU hosts one NCCL rank): CUDA tensors, the rebuild broadcast included.
TEST(NeedsAGpu, BucketedDdpOnNcclWorldOneMatchesSingleDevice) {
  if (!test_support::nccl_usable()) GTEST_SKIP() << "needs a CUDA libtorch with NCCL and a GPU";
  TrainConfig c;
  c.model = "tiny_gpt";
  c.steps = 4;
  c.global_batch = 8;
  c.micro_batches = 2;
  c.device = "cuda:0";
  Options options;
  options.caps = {2048, 8192};
  GroupOptions group = test_group();
  group.kind = BackendKind::kNccl;
  const ReferenceResult ref = train_reference(c);
  std::vector<at::Tensor> final_params;
  size_t buckets = 0;
  run_ranks(
      1, [&](Communicator& comm) { final_params = train_rank(comm, c, options, &buckets); }, group);
  const double diff = max_abs_diff(final_params, ref.params);
  std::cout << "nccl world 1: " << buckets << " buckets, max |param - reference| = " << diff << "\n";
  EXPECT_GT(buckets, 1u);
  EXPECT_TRUE(all_close(final_params, ref.params, kRtol, kAtol)) << "max diff " << diff;
}

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

// Task 2: every rank leaves with rank 0's order, in one broadcast of one int64 per entry, waited for.
TEST(AgreeOnOrder, EveryRankGetsRankZerosOrderInOneBroadcast) {
  const int world = 3;
  std::vector<Watch> watches(world);
  std::vector<std::vector<size_t>> agreed(world);
  std::vector<std::vector<CollectiveRecord>> recs(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        std::vector<size_t> mine(5);
        std::iota(mine.begin(), mine.end(), size_t{0});
        std::rotate(mine.begin(), mine.begin() + comm.rank() + 1, mine.end());  // a different order on every rank
        agreed[comm.rank()] = agree_on_order(comm, mine, test_support::device());
        recs[comm.rank()] = comm.recorder().since(0);
      },
      watched_group(watches));
  const std::vector<size_t> rank0{1, 2, 3, 4, 0};
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(agreed[r], rank0) << "rank " << r;
    ASSERT_EQ(recs[r].size(), 1u) << "rank " << r << ": one collective";
    EXPECT_EQ(recs[r][0].op, "broadcast");
    EXPECT_EQ(recs[r][0].numel, 5);
    EXPECT_EQ(recs[r][0].bytes, 5 * 8) << "int64 entries";
    EXPECT_EQ(watches[r].waited_ns.size(), 1u) << "rank " << r << ": the broadcast is waited for before returning";
  }
  std::cout << "every rank got rank 0's order 1 2 3 4 0 in " << recs[1].size() << " broadcast of " << recs[1][0].bytes
            << " bytes\n";
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
        Options options;
        options.caps = {2048, 8192};
        BucketedDDP ddp(model, comm, options);
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
            const at::Tensor& g = ddp.parameters()[i].grad();
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

// Structure: per step exactly one all-reduce (average) per bucket, of the bucket's size, in bucket order; the
// rebuild adds one broadcast of the order (int64, one entry per parameter) at the start of step 1.
TEST(BucketedDDP, OneAllReducePerBucketOfTheBucketsSizeInOrder) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("tiny_gpt", 3);
        Options options;
        options.caps = {2048, 8192};
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset("tiny_gpt", 3);
        auto opt = make_optimizer("sgd", trainable_parameters(*model), 0.05);
        for (int step = 0; step < 3; ++step) {
          compat::zero_grad(*opt);
          const size_t mark = comm.recorder().size();
          at::Tensor loss = ddp.loss(rank_slice(data->global_batch(step, 4), comm.rank(), 2));
          const size_t after_forward = comm.recorder().size();
          loss.backward();
          const auto forward_recs = comm.recorder().since(mark);
          const auto recs = comm.recorder().since(after_forward);
          if (step == 1) {
            ASSERT_EQ(after_forward - mark, 1u) << "the rebuild broadcasts the order once";
            EXPECT_EQ(forward_recs[0].op, "broadcast");
            EXPECT_EQ(forward_recs[0].numel, static_cast<int64_t>(ddp.parameters().size()));
          } else {
            EXPECT_EQ(after_forward, mark) << "no collective in the forward of step " << step;
          }
          const auto& buckets = ddp.buckets();
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
          opt->step();
        }
        int64_t total = 0;
        for (const auto& b : ddp.buckets()) total += b.numel;
        int64_t expected = 0;
        for (const auto& p : trainable_parameters(*model)) expected += p.numel();
        EXPECT_EQ(total, expected) << "every trainable parameter is in exactly one bucket";
      },
      test_group());
}

TEST(BucketedDDP, FirstBucketStartsBeforeBackwardEnds) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("tiny_gpt", 4);
        Options options;
        options.caps = {4096, 16384};
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset("tiny_gpt", 4);
        ASSERT_GE(ddp.buckets().size(), 3u);
        for (int step = 0; step < 3; ++step) {
          const size_t mark = comm.recorder().size();
          at::Tensor loss = ddp.loss(rank_slice(data->global_batch(step, 8), comm.rank(), 2));
          const size_t start = comm.recorder().size();
          loss.backward();
          (void)mark;
          const auto recs = comm.recorder().since(start);
          ASSERT_FALSE(recs.empty());
          const int64_t lead = ddp.backward_compute_end_ns() - recs.front().start_ns;
          if (comm.rank() == 0)
            std::cout << "step " << step << ": first bucket's all-reduce started " << lead / 1000.0
                      << " us before backward finished computing (" << recs.size() << " buckets)\n";
          EXPECT_LT(recs.front().start_ns, ddp.backward_compute_end_ns())
              << "the first bucket must be launched during backward, not after it";
          EXPECT_LT(recs.front().start_ns, recs.back().start_ns);
        }
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
        auto model = make_model("tiny_gpt", 5);
        Options options;
        options.caps = {2048, 8192};
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset("tiny_gpt", 5);
        auto opt = make_optimizer("sgd", trainable_parameters(*model), 0.05);
        const at::Tensor buffer = ddp.grad_buffer(at::kFloat);
        ASSERT_TRUE(buffer.defined());
        auto check = [&](const char* when) {
          const at::Tensor buf = ddp.grad_buffer(at::kFloat);
          const auto* begin = static_cast<const char*>(buf.data_ptr());
          const auto* end = begin + buf.numel() * buf.element_size();
          for (size_t i = 0; i < ddp.parameters().size(); ++i) {
            const at::Tensor g = ddp.parameters()[i].grad();
            ASSERT_TRUE(g.defined()) << when << ": " << ddp.parameter_names()[i];
            EXPECT_TRUE(g.is_alias_of(buf)) << when << ": " << ddp.parameter_names()[i];
            const auto* p = static_cast<const char*>(g.data_ptr());
            EXPECT_TRUE(p >= begin && p + g.numel() * g.element_size() <= end) << when;
          }
        };
        check("after construction");
        for (int step = 0; step < 3; ++step) {
          compat::zero_grad(*opt);
          ddp.loss(rank_slice(data->global_batch(step, 4), comm.rank(), 2)).backward();
          check("after backward");
          // layout: bucket b's slice is exactly its parameters' gradients, in bucket order (same memory)
          for (const auto& b : ddp.buckets()) {
            int64_t at = 0;
            for (size_t i : b.params) {
              const at::Tensor g = ddp.parameters()[i].grad();
              EXPECT_TRUE(at::equal(b.flat.narrow(0, at, g.numel()), g.reshape({-1})));
              at += g.numel();
            }
          }
          opt->step();
        }
        // Something drops a .grad (libtorch 2.x zero_grad sets them to None): the next forward re-attaches a view.
        at::Tensor& g0 = ddp.parameters()[0].mutable_grad();
        g0 = at::Tensor();
        ddp.parameters()[1].mutable_grad() = at::ones_like(ddp.parameters()[1]);
        ddp.loss(rank_slice(data->global_batch(3, 4), comm.rank(), 2));
        check("after a .grad was dropped and another replaced");
        EXPECT_EQ(ddp.parameters()[0].grad().abs().sum().item<double>(), 0.0) << "a dropped grad comes back as zeros";
        EXPECT_EQ(ddp.parameters()[1].grad().sum().item<double>(), static_cast<double>(ddp.parameters()[1].numel()))
            << "a replaced grad keeps its value";
      },
      test_group());
}

// libtorch 2.x's zero_grad() drops every .grad; a user may call it between the forward and backward. The
// gradients then arrive in new tensors, and must still be averaged (moved into their slots when they arrive).
TEST(BucketedDDP, GradientsDroppedBetweenForwardAndBackwardAreStillAveraged) {
  TrainConfig c;
  c.model = "mlp";
  c.steps = 3;
  c.global_batch = 8;
  c.seed = 4;
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> finals(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed);
        Options options;
        options.caps = mlp_caps(3);
        BucketedDDP ddp(model, comm, options);
        auto data = make_dataset(c.model, c.seed);
        auto opt = make_optimizer(c.optimizer, trainable_parameters(*model), c.lr);
        for (int step = 0; step < c.steps; ++step) {
          at::Tensor loss = ddp.loss(rank_slice(data->global_batch(step, c.global_batch), comm.rank(), 2));
          for (const auto& p : ddp.parameters()) p.mutable_grad() = at::Tensor();  // zero_grad(set_to_none)
          loss.backward();
          for (size_t i = 0; i < ddp.parameters().size(); ++i)
            EXPECT_TRUE(ddp.parameters()[i].grad().is_alias_of(ddp.grad_buffer(at::kFloat)))
                << ddp.parameter_names()[i];
          opt->step();
        }
        finals[comm.rank()] = model->parameters();
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    const double diff = max_abs_diff(finals[r], ref.params);
    std::cout << "rank " << r << ": max |param - reference| = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << "rank " << r << " max diff " << diff;
  }
}

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
        const Batch aborted = rank_slice(data->global_batch(0, 8), comm.rank(), 2);
        const Batch after = rank_slice(data->global_batch(1, 8), comm.rank(), 2);
        own_aborted[comm.rank()] = test_support::local_gradients(*model, aborted, params);
        own_next[comm.rank()] = test_support::local_gradients(*model, after, params);
        // fc0.weight is the last gradient backward reaches: throw there, after the later layers' buckets launched.
        const size_t mark = comm.recorder().size();
        EXPECT_TRUE(test_support::backward_cut_short_at(params.front(), [&] { ddp.loss(aborted).backward(); }));
        launched[comm.rank()] = comm.recorder().size() - mark;
        at::Tensor loss = ddp.loss(after);  // settles the aborted backward first
        size_t done = 0;
        for (const auto& r : comm.recorder().since(mark)) done += r.end_ns != 0 ? 1 : 0;
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

TEST(BucketedDDP, NoSyncSkipsCommunicationThenTheNextBackwardAveragesAndFrozenParametersStayOut) {
  test_support::expect_no_sync_contract("edge", [](std::shared_ptr<Model> model, Communicator& comm) {
    Options options;
    options.find_unused_parameters = true;
    auto ddp = std::make_unique<BucketedDDP>(model, comm, options);
    for (const auto& name : ddp->parameter_names()) EXPECT_NE(name, "frozen");
    EXPECT_EQ(ddp->parameters().size(), trainable_parameters(*model).size());
    return ddp;
  });
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

// Clipping after the buckets' averages (BucketedDDP::clip_grad_norm): no collective; a bound that binds trains
// like the clipped single device, in the 2-norm and the max norm, with three buckets.
TEST(BucketedDDP, ClippingMatchesTheClippedSingleDevice) {
  TrainConfig base;
  base.model = "mlp";
  base.steps = 4;
  for (const double p : {2.0, test_support::kInfNorm}) {
    const TrainConfig c = test_support::binding_clip(base, 0.01, p);
    const ReferenceResult ref = train_reference(c);
    Options options;
    options.caps = mlp_caps(3);
    std::vector<std::vector<at::Tensor>> finals(2);
    run_ranks(
        2, [&](Communicator& comm) { finals[comm.rank()] = train_rank(comm, c, options); }, test_group());
    for (int r = 0; r < 2; ++r) {
      const double diff = max_abs_diff(finals[r], ref.params);
      std::cout << "p " << p << " rank " << r << ": max |param - clipped reference| = " << diff << "\n";
      EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << "rank " << r << " max diff " << diff;
    }
  }
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

/// "[2, 0, 1] (numel 21, 42, 54)": buckets by index, with their sizes.
std::string show_buckets(const std::vector<size_t>& order, const std::vector<Bucket>& buckets) {
  std::ostringstream s;
  s << "[";
  for (size_t k = 0; k < order.size(); ++k) s << (k ? ", " : "") << order[k];
  s << "] (numel ";
  for (size_t k = 0; k < order.size(); ++k) s << (k ? ", " : "") << buckets[order[k]].numel;
  s << ")";
  return s.str();
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
