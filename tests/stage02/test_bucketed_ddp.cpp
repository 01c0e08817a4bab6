// Stage 02 — bucketed DDP. N ranks (threads, real Gloo) must train exactly like one device, with one all-reduce
// per bucket, the first of them started while backward is still running, and buckets rebuilt from the real
// gradient-ready order.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/bucketed_ddp/order_agreement.h"
#include "shardlab/common/compat.h"
#include "shardlab/common/data.h"
#include "shardlab/common/reference.h"
#include "shardlab/common/thread_ranks.h"

#include "support/device.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/no_sync.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <iostream>
#include <numeric>

namespace shardlab::bucketed_ddp {
namespace {

using test_support::test_group;

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
  // tiny GPT (SGD: see Note [AdamW and near-zero gradients] in tests/stage01) with many small buckets
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

// Task 2: every rank leaves with rank 0's order, in one broadcast of one int64 per entry.
TEST(AgreeOnOrder, EveryRankGetsRankZerosOrderInOneBroadcast) {
  const int world = 3;
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
      test_group());
  const std::vector<size_t> rank0{1, 2, 3, 4, 0};
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(agreed[r], rank0) << "rank " << r;
    ASSERT_EQ(recs[r].size(), 1u) << "rank " << r << ": one collective";
    EXPECT_EQ(recs[r][0].op, "broadcast");
    EXPECT_EQ(recs[r][0].numel, 5);
    EXPECT_EQ(recs[r][0].bytes, 5 * 8) << "int64 entries";
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
    EXPECT_EQ(completed[r], launched[r]) << "the forward must wait for every bucket the aborted backward launched";
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
