// Gradient clipping by the global norm over gradients sharded across ranks (grad_clip.h, Note [A norm over shards]),
// and the Communicator's ReduceOp::kMax it needs. Ranks are threads on real Gloo groups.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/model/grad_clip.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <limits>

namespace shardlab {
namespace {

using test_support::test_group;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Three "parameters" whose gradients are the full tensors below. Over 3 ranks torch.chunk gives 5 rows as 2, 2, 1
// and 2 rows as 1, 1, 0: rank 2 holds an empty chunk of the last.
std::vector<at::Tensor> full_grads() {
  auto gen = at::detail::createCPUGenerator(7);
  return {at::randn({5, 4}, gen, at::TensorOptions().dtype(at::kFloat)) * 3,
          at::randn({7}, gen, at::TensorOptions().dtype(at::kFloat)),
          at::randn({2, 3}, gen, at::TensorOptions().dtype(at::kFloat)) * 10};
}

// Rank `rank`'s rows of `full` (torch.chunk's chunks: ceil(d0 / world) rows each, the last ones short or empty), as
// a parameter holding them as its gradient.
at::Tensor shard_param(const at::Tensor& full, int rank, int world) {
  const int64_t rows = full.size(0), per = (rows + world - 1) / world;
  const int64_t first = std::min(rows, rank * per), count = std::max<int64_t>(0, std::min(per, rows - first));
  at::Tensor p = at::zeros(full.narrow(0, first, count).sizes(), full.options());
  p.mutable_grad() = full.narrow(0, first, count).clone();
  return p;
}

double reference_norm(const std::vector<at::Tensor>& full, double p) {
  std::vector<at::Tensor> flat;
  for (const auto& g : full) flat.push_back(g.reshape({-1}).to(at::kDouble));
  const at::Tensor all = at::cat(flat);
  return std::isinf(p) ? all.abs().max().item<double>() : all.abs().pow(p).sum().pow(1.0 / p).item<double>();
}

TEST(GradClip, AShardedNormEqualsTheNormOfTheFullGradientWithOneAllReduce) {
  const int world = 3;
  const auto full = full_grads();
  for (const double p : {2.0, kInf, 1.0}) {
    SCOPED_TRACE("p = " + std::to_string(p));
    const double want = reference_norm(full, p);
    std::vector<double> got(world);
    std::vector<std::vector<CollectiveRecord>> records(world);
    run_ranks(
        world,
        [&](Communicator& comm) {
          std::vector<at::Tensor> params;
          for (const auto& g : full) params.push_back(shard_param(g, comm.rank(), world));
          const size_t marker = comm.recorder().size();
          got[comm.rank()] = total_grad_norm(params, p, &comm);
          records[comm.rank()] = comm.recorder().since(marker);
        },
        test_group());
    for (int r = 0; r < world; ++r) {
      std::cout << "p " << p << " rank " << r << ": " << got[r] << " vs one device " << want << " (diff "
                << got[r] - want << ")\n";
      if (std::isinf(p)) {
        EXPECT_EQ(got[r], want) << "rank " << r << ": the max norm is exact";
      } else {
        EXPECT_NEAR(got[r], want, 1e-12 * want) << "rank " << r;
      }
      ASSERT_EQ(records[r].size(), 1u) << "rank " << r << ": one all-reduce joins the partial results";
      EXPECT_EQ(records[r][0].op, "all_reduce");
      EXPECT_EQ(records[r][0].numel, 1);
      EXPECT_EQ(records[r][0].dtype, at::kDouble);
      EXPECT_EQ(records[r][0].reduce, std::isinf(p) ? "max" : "sum");
    }
  }
}

TEST(GradClip, ATiedWeightListedTwiceCountsOnce) {
  const auto full = full_grads();
  std::vector<at::Tensor> params;
  for (const auto& g : full) params.push_back(shard_param(g, 0, 1));
  const std::vector<at::Tensor> tied{params[0], params[1], params[2], params[0]};  // params[0] listed twice
  EXPECT_NEAR(total_grad_norm(tied, 2.0, nullptr), reference_norm(full, 2.0), 1e-12 * reference_norm(full, 2.0));
  EXPECT_EQ(total_grad_norm(tied, kInf, nullptr), reference_norm(full, kInf));
}

// PyTorch's rule: every gradient times min(1, max_norm / (total + 1e-6)); a bound above the norm changes nothing.
TEST(GradClip, ScalesByPyTorchsCoefficientOnlyWhenTheNormIsAboveTheBound) {
  const auto full = full_grads();
  for (const double p : {2.0, kInf}) {
    std::vector<at::Tensor> params;
    for (const auto& g : full) params.push_back(shard_param(g, 0, 1));
    const double total = reference_norm(full, p);
    const double max_norm = total / 4;
    const std::vector<at::Tensor> tied{params[0], params[1], params[2], params[0]};
    EXPECT_NEAR(clip_grad_norm(tied, max_norm, p, nullptr), total, 1e-12 * total) << "returns the norm before";
    const double coef = max_norm / (total + 1e-6);
    for (size_t i = 0; i < full.size(); ++i)
      EXPECT_TRUE(at::allclose(params[i].grad(), full[i] * coef, 1e-6, 0))
          << "p " << p << " gradient " << i << " (a tied weight is scaled once): max diff "
          << (params[i].grad() - full[i] * coef).abs().max().item<double>();
    EXPECT_NEAR(total_grad_norm(params, p, nullptr), max_norm, 1e-5 * max_norm) << "the norm after clipping";
    const std::vector<at::Tensor> before{params[0].grad().clone(), params[1].grad().clone(), params[2].grad().clone()};
    clip_grad_norm(params, 10 * max_norm, p, nullptr);
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(at::equal(params[i].grad(), before[i])) << "a bound above the norm must leave gradient " << i;
  }
}

TEST(GradClip, BadArgumentsAreRefusedNamingThem) {
  std::vector<at::Tensor> params{shard_param(full_grads()[0], 0, 1)};
  for (const double p : {0.0, -2.0, std::nan("")}) {
    try {
      clip_grad_norm(params, 1.0, p, nullptr);
      ADD_FAILURE() << "p = " << p << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("norm type p > 0"), std::string::npos) << e.what();
    }
  }
  for (const double max_norm : {-1.0, kInf, std::nan("")}) {
    try {
      clip_grad_norm(params, max_norm, 2.0, nullptr);
      ADD_FAILURE() << "max_norm = " << max_norm << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("finite max_norm >= 0"), std::string::npos) << e.what();
    }
  }
}

TEST(Collectives, AllReduceMaxTakesTheElementwiseMaximumAndReduceScatterRefusesIt) {
  const int world = 3;
  std::vector<at::Tensor> got(world);
  std::vector<std::string> refused(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        const double r = comm.rank();
        at::Tensor t = at::tensor({r, -r, r == 1 ? 5.0 : 0.0}, at::TensorOptions().dtype(at::kDouble));
        comm.all_reduce(t, ReduceOp::kMax).wait();
        got[comm.rank()] = t;
        try {
          comm.reduce_scatter(at::zeros({1}), at::zeros({world}), ReduceOp::kMax);
        } catch (const std::invalid_argument& e) {
          refused[comm.rank()] = e.what();
        }
      },
      test_group());
  const at::Tensor want = at::tensor({2.0, 0.0, 5.0}, at::TensorOptions().dtype(at::kDouble));
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(at::equal(got[r], want)) << "rank " << r << ": " << got[r];
    EXPECT_NE(refused[r].find("kMax"), std::string::npos) << "rank " << r << ": '" << refused[r] << "'";
  }
}

}  // namespace
}  // namespace shardlab
