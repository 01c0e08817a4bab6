// Stage 04, task 4 — FSDP on units trains exactly like one device: N ranks (threads, real Gloo) against one device
// on the union batch for every model and optimizer, clipped by the whole model's norm, and with a parameter that one
// rank's batch never reaches.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/model/grad_clip.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/clipping.h"
#include "support/device.h"
#include "support/fsdp_case.h"
#include "support/gradients.h"
#include "support/param_name.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <iostream>
#include <sstream>
#include <string>

namespace shardlab::fsdp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

using Case = test_support::FsdpCase;

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, MatchesSingleDeviceReference) {
  const Case& e = GetParam();
  TrainConfig c = test_support::equivalence_config(e.model, e.optimizer, e.micro)
                      .steps(4)
                      .global_batch(12 % (e.world * e.micro) == 0 ? 12 : 4 * e.world * e.micro)
                      .seed(13);
  test_support::expect_case_trains_like_one_device(e, c, device_of(c), [&](Communicator& comm, const Options& o) {
    return FullyShardedModel(make_model(c, device_of(c)), comm, o);
  });
}

std::vector<Case> cases() {
  // tiny GPT with SGD: see Note [Comparing with one device] in common/course/src/reference.cpp.
  return {{"tiny_gpt", "sgd", 2, 1, true}, {"tiny_gpt", "sgd", 3, 2, false}, {"tiny_gpt", "sgd", 4, 1, true},
          {"mlp", "sgd", 1, 1, true},      {"mlp", "adamw", 2, 1, true},     {"mlp", "adamw", 3, 3, true},
          {"mlp", "sgd", 4, 2, false},     {"edge", "sgd", 2, 1, true},      {"edge", "adamw", 3, 2, false},
          {"edge", "sgd", 4, 1, true}};
}

INSTANTIATE_TEST_SUITE_P(Stage04, Equivalence, ::testing::ValuesIn(cases()), test_support::StreamedName());

// Clipping the shards by the whole model's norm (FullyShardedModel::clip_grad_norm, Note [A norm over shards]):
// one all-reduce of one double per call (SUM of |g|^p; MAX for the max norm), the same norm on every rank as the
// single device's full gradient (rtol 1e-6: the shards' gradients differ from one device's by the reductions'
// rounding), and training with a bound that binds matches the clipped single device (3 ranks: padded shards).
TEST(FullyShardedModel, ClippingJoinsTheShardsNormsInOneAllReduceAndMatchesTheClippedSingleDevice) {
  TrainConfig base = test_support::config("tiny_gpt").steps(3).global_batch(6).seed(13);
  const int world = 3;
  for (const double p : {2.0, test_support::kInfNorm}) {
    const TrainConfig c = test_support::binding_clip(base, 0.05, p);
    const ReferenceResult ref = train_reference(c);
    // The single device's norm of the first step's full gradient.
    auto one = make_model(c, at::kCPU);
    one->loss(make_dataset(c.model, c.seed)->global_batch(0, c.global_batch)).backward();
    const double want = total_grad_norm(one->parameters(), p, nullptr);
    std::vector<std::vector<at::Tensor>> finals(world);
    run_ranks(
        world,
        [&](Communicator& comm) {
          auto model = make_model(c, at::kCPU);
          FullyShardedModel fsdp(model, comm);
          auto data = make_dataset(c.model, c.seed);
          fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), world)).backward();
          const size_t marker = comm.recorder().size();
          const double got = fsdp.clip_grad_norm(1e9, p);
          const auto records = comm.recorder().since(marker);
          EXPECT_NEAR(got, want, 1e-6 * want)
              << "rank " << comm.rank() << " p " << p << ": the norm over the shards differs from one device's";
          ASSERT_EQ(records.size(), 1u) << "rank " << comm.rank() << ": one all-reduce joins the shards' norms";
          EXPECT_EQ(records[0].op, "all_reduce");
          EXPECT_EQ(records[0].numel, 1);
          EXPECT_EQ(records[0].reduce, std::isinf(p) ? "max" : "sum");
          {
            auto scope = fsdp.no_sync();
            EXPECT_THROW(fsdp.clip_grad_norm(1.0, p), std::logic_error) << "inside no_sync";
          }
        },
        test_group());
    run_ranks(
        world,
        [&](Communicator& comm) {
          auto model = make_model(c, at::kCPU);
          FullyShardedModel fsdp(model, comm);
          test_support::train_steps(comm, c, fsdp.parameters(), at::kCPU, fsdp);
          finals[comm.rank()] = on_cpu(fsdp.full_parameters());
        },
        test_group());
    test_support::expect_ranks_match(finals, ref.params, "p", p);
  }
}

// Note [A parameter unused on some ranks]: a batch that never reaches a parameter the other ranks use. The unit's
// reduce-scatter comes at the end of that rank's backward, after the next unit's all-gather, where the other ranks
// launched it before: the ops interleave differently, and on Gloo with CPU tensors the result is still one device's
// on the union batch. 2 ranks (the ring reduce-scatter) and 4 (the all-reduce fallback of small ones).
TEST(FullyShardedModel, AParameterUnusedOnOneRankOnlyTrainsLikeOneDeviceOnGlooTensorsOnCpu) {
  // `extra` applies only to the examples whose first feature is positive: a rank without one never reaches it.
  struct Gated : torch::nn::Module {
    Gated() {
      main = register_module("main", torch::nn::Linear(4, 4));
      extra = register_module("extra", torch::nn::Linear(4, 4));
    }
    at::Tensor forward(const at::Tensor& x) {
      const at::Tensor rows = at::nonzero(x.select(1, 0) > 0).squeeze(1);
      at::Tensor y = main->forward(x);
      if (rows.numel() > 0) y = y.index_add(0, rows, extra->forward(x.index_select(0, rows)));
      return y;
    }
    torch::nn::Linear main{nullptr}, extra{nullptr};
  };
  struct Net : Model {
    Net() {
      first = register_unit("first", torch::nn::Linear(4, 4).ptr());
      gated = register_unit("gated", std::make_shared<Gated>());  // last in forward: first in backward
      init_parameters(*this, 3);
    }
    at::Tensor loss(const Batch& b) override { return gated(first(b.input)).pow(2).sum(1).mean(); }
    UnitRef<torch::nn::LinearImpl> first;
    UnitRef<Gated> gated;
  };
  // Rows 0 and 1 reach `extra` (their first feature after `first` is positive); the rest do not: found below.
  Batch global;
  global.input = at::linspace(-2.0, 2.0, 32).reshape({8, 4});
  global.target = at::zeros({8}, at::kLong);
  {
    Net probe;
    torch::NoGradGuard no_grad;
    const at::Tensor h = probe.first->forward(global.input);
    at::Tensor sign = at::ones({8});
    for (int64_t i = 0; i < 8; ++i) sign[i] = i < 2 ? 1.0 : -1.0;
    // Shift each row so that its first feature after `first` has the sign wanted.
    const at::Tensor w0 = probe.first->weight[0];
    const at::Tensor shift = (sign * (h.select(1, 0).abs() + 0.5) - h.select(1, 0)) / w0.pow(2).sum();
    global.input = global.input + shift.unsqueeze(1) * w0.unsqueeze(0);
    const at::Tensor check = probe.first->forward(global.input).select(1, 0);
    ASSERT_TRUE(at::equal(check > 0, sign > 0)) << "the batch was not built as intended: " << check;
  }
  Net reference;
  reference.loss(global).backward();
  const std::vector<at::Tensor> ref_grads = test_support::grad_copies(reference.parameters());

  for (int world : {2, 4}) {
    std::vector<std::vector<at::Tensor>> grads(world);
    std::vector<std::vector<std::string>> ops(world);
    run_ranks(
        world,
        [&](Communicator& comm) {
          auto model = std::make_shared<Net>();
          Options options;
          options.allow_unused_parameters = true;
          FullyShardedModel fsdp(model, comm, options);
          const size_t start = comm.recorder().size();
          fsdp.loss(rank_slice(global, comm.rank(), world)).backward();
          for (const auto& r : comm.recorder().since(start)) ops[comm.rank()].push_back(r.op + " " + r.wire_op);
          grads[comm.rank()] = test_support::grad_copies(fsdp.parameters());
        },
        test_group());
    // The ops interleave differently: rank 0 reduces `gated` before gathering `first` for its backward, a rank
    // without `extra`'s gradient after it. Every rank issues the same reduce-scatters, in the same order.
    auto reduce_scatters = [](const std::vector<std::string>& v) {
      std::vector<std::string> out;
      for (const auto& s : v)
        if (s.rfind("reduce_scatter", 0) == 0) out.push_back(s);
      return out;
    };
    std::ostringstream seen;
    for (int r = 0; r < world; ++r) {
      seen << "rank " << r << ":";
      for (const auto& s : ops[r]) seen << " [" << s << "]";
      seen << "\n";
    }
    std::cout << "world " << world << "\n" << seen.str();
    EXPECT_NE(ops[0], ops[1]) << "the test must make the ranks interleave differently\n" << seen.str();
    for (int r = 1; r < world; ++r) EXPECT_EQ(reduce_scatters(ops[r]), reduce_scatters(ops[0])) << seen.str();
    if (world == 4)
      EXPECT_NE(ops[0].back().find("all_reduce"), std::string::npos)
          << "at 4 ranks the small reduce-scatters take the all-reduce fallback\n"
          << seen.str();
    // Each rank's rows of every gradient (4 rows split evenly: no padding) against the reference's same rows.
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(grads[r].size(), ref_grads.size());
      for (size_t i = 0; i < ref_grads.size(); ++i) {
        const at::Tensor& got = grads[r][i];
        const at::Tensor want = ref_grads[i].narrow(0, r * got.size(0), got.size(0));
        const double diff = (got - want).abs().max().item<double>();
        EXPECT_TRUE(at::allclose(got, want, kRtol, kAtol))
            << "world " << world << " rank " << r << " parameter " << i << ": max |grad - reference| " << diff;
      }
    }
  }
}

}  // namespace
}  // namespace shardlab::fsdp
