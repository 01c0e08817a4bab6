// Stage 04, task 4 — FSDP's mixed precision: all-gathers in the param dtype, reduce-scatters in the reduce dtype and
// f32 shards, FSDP2's clamping rules, and one device that applies the same casts matched (bit for bit at one rank).
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/mixed_precision.h"
#include "support/spaced_batch.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/linear.h>

#include <iostream>
#include <sstream>

namespace shardlab::fsdp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

TEST(FullyShardedModel, MixedPrecisionGathersInBf16ReducesInF32AndKeepsF32Shards) {
  TrainConfig c = test_support::config("mlp").steps(3).global_batch(8).micro_batches(2);
  const ReferenceResult ref = train_reference(c);
  std::vector<at::Tensor> finals;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        FullyShardedModel fsdp(model, comm, test_support::bf16_compute_f32_reduce());
        for (const auto& unit : fsdp.units()) {
          EXPECT_EQ(unit->dtypes().param, at::kBFloat16);
          EXPECT_EQ(unit->dtypes().reduce, at::kFloat);
          for (const auto& fp : unit->params()) {
            EXPECT_EQ(fp.param.scalar_type(), at::kBFloat16) << fp.name << ": computes in the param dtype";
            EXPECT_EQ(fp.sharded.scalar_type(), at::kFloat) << fp.name << ": the shard stays in the original dtype";
          }
        }
        const size_t start = comm.recorder().size();
        test_support::train_steps(comm, c, fsdp.parameters(), at::kCPU, fsdp);
        for (const auto& r : comm.recorder().since(start)) {
          if (r.op == "all_gather") EXPECT_EQ(r.dtype, at::kBFloat16) << "all-gather in the param dtype";
          if (r.op == "reduce_scatter") EXPECT_EQ(r.dtype, at::kFloat) << "reduce-scatter in the reduce dtype";
        }
        for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
        auto full = on_cpu(fsdp.full_parameters());
        if (comm.rank() == 0) finals = full;
      },
      test_group());
  const double diff = max_abs_diff(finals, ref.params);
  std::cout << "bf16 compute, f32 reduce vs the f32 reference: max |param diff| = " << diff << "\n";
  EXPECT_LT(diff, 2e-2) << "bf16 keeps 8 bits of mantissa: about 1e-2 after 3 steps";
  EXPECT_GT(diff, 0) << "bf16 compute cannot be bit-identical to f32";
}

// FSDP2's clamping rules: with only a param dtype, gradients are reduced in it (reduce == param: no second cast),
// and a unit whose parameters are not floating is never cast (gathered exactly, in its own dtype).
TEST(FullyShardedModel, MixedPrecisionClampsAsFsdp2) {
  struct WithCounter : Model {
    WithCounter() {
      fc = register_unit("fc", torch::nn::Linear(4, 3).ptr());
      init_parameters(*this, 3);  // before the counter: a random init of an integer tensor is not defined
      counter = register_unit("counter", std::make_shared<Counter>());
    }
    struct Counter : torch::nn::Module {
      Counter() { n = register_parameter("n", at::arange(5, at::kLong) * 1000003, /*requires_grad=*/false); }
      at::Tensor forward(const at::Tensor& x) { return x * n.sum().to(x.scalar_type()) * 0 + x; }
      at::Tensor n;
    };
    at::Tensor loss(const Batch& b) override { return counter(fc(b.input)).pow(2).mean(); }
    UnitRef<torch::nn::LinearImpl> fc;
    UnitRef<Counter> counter;
  };
  const Batch global = test_support::spaced_batch(4, 4);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<WithCounter>();
        Options options;
        options.mixed_precision.param_dtype = at::kBFloat16;  // no reduce dtype: it is the param dtype
        FullyShardedModel fsdp(model, comm, options);
        ASSERT_EQ(fsdp.units().size(), 2u) << "two units, no root";
        const FsdpUnit& fc = *fsdp.units()[0];
        const FsdpUnit& counter = *fsdp.units()[1];
        EXPECT_EQ(fc.dtypes().reduce, at::kBFloat16) << "reduce dtype unset: the param dtype";
        EXPECT_EQ(counter.dtypes().param, at::kLong) << "a non-floating unit is never cast";
        const size_t start = comm.recorder().size();
        fsdp.loss(rank_slice(global, comm.rank(), comm.size())).backward();
        std::ostringstream order;
        size_t long_gathers = 0, reduce_scatters = 0;
        for (const auto& r : comm.recorder().since(start)) {
          order << r.op << " " << c10::toString(r.dtype) << "; ";
          if (r.op == "all_gather" && r.dtype == at::kLong) ++long_gathers;
          if (r.op == "all_gather" && r.dtype != at::kLong) EXPECT_EQ(r.dtype, at::kBFloat16) << "fc: the param dtype";
          if (r.op == "reduce_scatter") {
            ++reduce_scatters;
            EXPECT_EQ(r.dtype, at::kBFloat16) << "reduced in the param dtype, no second cast";
          }
        }
        if (comm.rank() == 0) std::cout << "collectives: " << order.str() << "\n";
        EXPECT_GE(long_gathers, 1u) << order.str();
        EXPECT_GE(reduce_scatters, 1u) << order.str();
        const at::Tensor n = fsdp.full_parameters().back();  // the counter's, gathered again (in its own dtype)
        EXPECT_EQ(n.scalar_type(), at::kLong);
        EXPECT_TRUE(at::equal(n, at::arange(5, at::kLong) * 1000003)) << n;
        for (const auto& p : fsdp.parameters())
          if (p.requires_grad()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << "the shard's dtype";
      },
      test_group());
}

// The same casts on one device: the f32 master weights cast to bf16, forward and backward in bf16 (inputs cast
// as FSDP casts a unit's input), the gradients cast to f32, the optimizer on the f32 masters. At 1 rank FSDP does
// exactly these operations: bit for bit. At 2 ranks each rank's bf16 backward sees half the batch and the f32 mean
// of the two differs from one bf16 backward over the whole batch by bf16 rounding, no more.
TEST(FullyShardedModel, MixedPrecisionMatchesAReferenceThatAppliesTheSameCasts) {
  for (int micro : {1, 2}) {  // 2: micro-batch gradients are accumulated in f32 (the reduce dtype) between them
    TrainConfig c = test_support::config("mlp").steps(3).global_batch(8).micro_batches(micro);
    auto master = make_model(c, at::kCPU);
    auto compute = make_model(c, at::kCPU);
    compute->to(at::kBFloat16);
    auto data = make_dataset(c.model, c.seed);
    auto opt = make_optimizer(c.optimizer, trainable_parameters(*master), c.lr);
    for (int step = 0; step < c.steps; ++step) {
      compat::zero_grad(*opt);
      {
        torch::NoGradGuard no_grad;
        auto m = master->parameters(), w = compute->parameters();
        for (size_t i = 0; i < m.size(); ++i) w[i].copy_(m[i]);
      }
      for (const Batch& mb : micro_batches(data->global_batch(step, c.global_batch), micro)) {
        for (auto& w : compute->parameters()) w.mutable_grad().reset();
        Batch b = mb;
        b.input = b.input.to(at::kBFloat16);
        (compute->loss(b) / micro).backward();
        auto m = master->parameters(), w = compute->parameters();
        for (size_t i = 0; i < m.size(); ++i) {
          at::Tensor& g = m[i].mutable_grad();
          if (g.defined())
            g.add_(w[i].grad().to(at::kFloat));
          else
            g = w[i].grad().to(at::kFloat);
        }
      }
      opt->step();
    }
    const std::vector<at::Tensor> reference = on_cpu(master->parameters());
    for (int world : {1, 2}) {
      std::vector<at::Tensor> finals;
      run_ranks(
          world,
          [&](Communicator& comm) {
            auto model = make_model(c, at::kCPU);
            FullyShardedModel fsdp(model, comm, test_support::bf16_compute_f32_reduce());
            test_support::train_steps(comm, c, fsdp.parameters(), at::kCPU, fsdp);
            auto full = on_cpu(fsdp.full_parameters());
            if (comm.rank() == 0) finals = full;
          },
          test_group());
      const double diff = max_abs_diff(finals, reference);
      std::cout << "bf16/f32, " << micro << " micro-batch(es), " << world
                << " rank(s) vs the same casts on one device: max |param diff| = " << diff << "\n";
      if (world == 1)
        EXPECT_EQ(diff, 0.0) << "one rank does exactly the reference's operations";
      else
        EXPECT_LT(diff, 2e-3) << "bf16 rounding of half-batch backward passes only";
    }
  }
}

}  // namespace
}  // namespace shardlab::fsdp
