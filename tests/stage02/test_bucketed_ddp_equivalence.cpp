// Stage 02 — bucketed DDP trains exactly like one device: N ranks (threads, real Gloo) against one device on the
// union batch with one to many buckets (rebuilt after the first step), under no_sync, with gradients dropped between
// forward and backward, and clipped; one rank on NCCL where there is a GPU.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "stage02/bucketed_ddp_support.h"
#include "support/clipping.h"
#include "support/device.h"
#include "support/group.h"
#include "support/no_sync.h"
#include "support/param_name.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>
#include <string>

namespace shardlab::bucketed_ddp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

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
  // 5 steps: step 1 rebuilds the buckets, later steps run on the rebuilt layout
  TrainConfig c = test_support::equivalence_config(e.model, e.optimizer, e.micro).steps(5).global_batch(12).seed(11);
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

INSTANTIATE_TEST_SUITE_P(Stage02, Equivalence, ::testing::ValuesIn(equivalence_cases()), test_support::StreamedName());

// World size 1 on NCCL (one GPU hosts one NCCL rank): CUDA tensors, the rebuild broadcast included.
TEST(NeedsAGpu, BucketedDdpOnNcclWorldOneMatchesSingleDevice) {
  if (!test_support::nccl_usable()) GTEST_SKIP() << "needs a CUDA libtorch with NCCL and a GPU";
  TrainConfig c = test_support::config("tiny_gpt").steps(4).global_batch(8).micro_batches(2).device("cuda:0");
  const Options options = test_support::with_caps(test_support::gpt_caps());
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

// libtorch 2.x's zero_grad() drops every .grad; a user may call it between the forward and backward. The
// gradients then arrive in new tensors, and must still be averaged (moved into their slots when they arrive).
TEST(BucketedDDP, GradientsDroppedBetweenForwardAndBackwardAreStillAveraged) {
  TrainConfig c = test_support::config("mlp").steps(3).global_batch(8).seed(4);
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
  test_support::expect_ranks_match(finals, ref.params);
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

// Clipping after the buckets' averages (BucketedDDP::clip_grad_norm): no collective; a bound that binds trains
// like the clipped single device, in the 2-norm and the max norm, with three buckets.
TEST(BucketedDDP, ClippingMatchesTheClippedSingleDevice) {
  TrainConfig base = test_support::config("mlp").steps(4);
  for (const double p : {2.0, test_support::kInfNorm}) {
    const TrainConfig c = test_support::binding_clip(base, 0.01, p);
    const ReferenceResult ref = train_reference(c);
    Options options;
    options.caps = mlp_caps(3);
    std::vector<std::vector<at::Tensor>> finals(2);
    run_ranks(
        2, [&](Communicator& comm) { finals[comm.rank()] = train_rank(comm, c, options); }, test_group());
    test_support::expect_ranks_match(finals, ref.params, "p", p);
  }
}

}  // namespace
}  // namespace shardlab::bucketed_ddp
