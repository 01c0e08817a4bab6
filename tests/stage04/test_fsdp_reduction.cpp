// Stage 04, task 4 — FSDP's gradient reduction: a mean over the ranks, not a sum; one reducer per unit from
// Options::reducer (the seam stage 06 plugs into); stage 03's compressed hooks reduce-scattering in their dtype.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/compressed.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <set>
#include <string>

namespace shardlab::fsdp {
namespace {

using test_support::on_cpu;
using test_support::test_group;

TEST(FullyShardedModel, TheReductionIsAMeanNotASum) {
  // Both ranks see the same batch, rank r scales its loss by (r + 1): the mean gradient is 1.5x one rank's
  // unscaled gradient; a sum would be 3x (the bug FSDP2 has had on Gloo, PyTorch issue #162338).
  TrainConfig c = test_support::config("mlp").global_batch(4);
  auto reference = make_model(c, at::kCPU);
  const Batch batch = make_dataset(c.model, c.seed)->global_batch(0, c.global_batch);
  reference->loss(batch).backward();
  std::vector<at::Tensor> expected;
  for (const auto& g : test_support::grad_copies(reference->parameters())) expected.push_back(g * 1.5);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        FullyShardedModel fsdp(model, comm);
        (fsdp.loss(batch) * static_cast<double>(comm.rank() + 1)).backward();
        double diff = 0;
        size_t i = 0;
        for (const auto& unit : fsdp.units()) {
          for (const auto& fp : unit->params()) {
            const at::Tensor want =
                expected[i++].narrow(0, fp.spec.first_row_of(comm.rank()), fp.spec.rows_of(comm.rank()));
            if (want.numel() == 0) continue;
            const double d = (fp.sharded.grad() - want).abs().max().item<double>();
            diff = std::max(diff, d);
            // Exact: rank 1's gradient is 2g (scaling by 2 is exact throughout backward), g + 2g is one rounding, and
            // halving it is exact, as is 1.5 x g (the same rounding of 3g, halved).
            EXPECT_TRUE(at::equal(fp.sharded.grad(), want))
                << fp.name << " rank " << comm.rank() << " differs by " << d;
          }
        }
        if (comm.rank() == 0) std::cout << "max |sharded grad - 1.5 x single-rank grad| = " << diff << "\n";
      },
      test_group());
}

// Stage 03's hooks are FSDP's extension point: the compressed ones reduce-scatter a half-size copy (fp16 on every
// Gloo; bf16 where Gloo carries it, else as f32, and the record says so), cast back into the f32 shards, and train
// close to f32 (measured 3e-5 with fp16 and 4e-4 with bf16 after 3 steps: the gradients' rounding, nothing else).
TEST(FullyShardedModel, CompressedHooksReduceScatterInTheirDtypeAndTrainCloseToF32) {
  TrainConfig c = test_support::config("mlp").steps(3).global_batch(8);
  const ReferenceResult ref = train_reference(c);
  for (const auto& [hook, dtype] : test_support::compressed_reductions()) {
    const c10::ScalarType wire = dtype == at::kBFloat16 && !compat::gloo_features().bfloat16 ? at::kFloat : dtype;
    std::vector<at::Tensor> finals;
    run_ranks(
        2,
        [&, &hook = hook, &dtype = dtype](Communicator& comm) {
          auto model = make_model(c, at::kCPU);
          Options options;
          options.reducer = hook_reducers(hook);
          FullyShardedModel fsdp(model, comm, options);
          const size_t start = comm.recorder().size();
          test_support::train_steps(comm, c, fsdp.parameters(), at::kCPU, fsdp);
          size_t reduce_scatters = 0;
          for (const auto& r : comm.recorder().since(start)) {
            if (r.op != "reduce_scatter") continue;
            ++reduce_scatters;
            EXPECT_EQ(r.dtype, dtype) << hook << ": the hook reduce-scatters its own copy";
            EXPECT_EQ(r.wire_dtype, wire) << hook << ": what went on the wire";
          }
          EXPECT_EQ(reduce_scatters, static_cast<size_t>(c.steps) * fsdp.units().size()) << "one per unit per step";
          for (const auto& p : fsdp.parameters())
            EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << "the average is cast back into the f32 shards";
          auto full = on_cpu(fsdp.full_parameters());
          if (comm.rank() == 0) finals = full;
        },
        test_group());
    test_support::expect_close_to_f32(finals, ref.params, hook, hook + " hook vs the f32 reference");
  }
}

// The reduction is a per-unit object (Options::reducer, the seam stage 06's HSDP plugs into): FSDP asks the factory
// once per unit, in units() order, with the unit's shard group; each backward calls every unit's reducer once, with
// S rows of the unit's padded gradients; a reducer that wraps the default one trains bit for bit like the default.
// A factory that gives no reducer is an error naming the unit, raised before any parameter is touched.
class CountingReducer final : public GradientReducer {
 public:
  CountingReducer(std::shared_ptr<GradientReducer> inner, std::vector<std::string>* calls, std::string unit)
      : inner_(std::move(inner)), calls_(calls), unit_(std::move(unit)) {}
  Handle operator()(const at::Tensor& input, const at::Tensor& output) override {
    calls_->push_back(unit_ + ":" + std::to_string(input.numel()) + "/" + std::to_string(output.numel()));
    return (*inner_)(input, output);
  }
  int64_t scratch_bytes(c10::ScalarType dtype, int64_t numel, c10::Device device) const override {
    return inner_->scratch_bytes(dtype, numel, device);
  }
  std::string name() const override { return "counting"; }

 private:
  std::shared_ptr<GradientReducer> inner_;
  std::vector<std::string>* calls_;
  std::string unit_;
};

TEST(FullyShardedModel, EachUnitGetsItsOwnReducerFromTheFactory) {
  TrainConfig c = test_support::config("tiny_gpt").steps(2).global_batch(8);
  std::vector<at::Tensor> plain_finals, counted_finals;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto plain_model = make_model(c, at::kCPU);
        FullyShardedModel plain(plain_model, comm);
        test_support::train_steps(comm, c, plain.parameters(), at::kCPU, plain);
        auto plain_full = on_cpu(plain.full_parameters());

        std::vector<std::string> requests, calls;
        Options options;
        options.reducer = [&](const ReducerRequest& request) -> std::shared_ptr<GradientReducer> {
          EXPECT_EQ(request.mesh.shard, &comm) << request.unit << ": the unit is sharded over the wrapper's group";
          requests.push_back(request.unit + "#" + std::to_string(request.index));
          return std::make_shared<CountingReducer>(hook_reducers("reduce_scatter")(request), &calls, request.unit);
        };
        auto model = make_model(c, at::kCPU);
        FullyShardedModel fsdp(model, comm, options);
        std::vector<std::string> expected_requests, expected_calls;
        for (size_t u = 0; u < fsdp.units().size(); ++u) {
          const FsdpUnit& unit = *fsdp.units()[u];
          expected_requests.push_back(unit.name() + "#" + std::to_string(u));
          int64_t row = 0;
          for (const auto& fp : unit.params())
            if (fp.trainable) row += fp.spec.padded_numel();
          expected_calls.push_back(unit.name() + ":" + std::to_string(2 * row) + "/" + std::to_string(row));
        }
        EXPECT_EQ(requests, expected_requests) << "one request per unit, in units() order";
        test_support::train_steps(comm, c, fsdp.parameters(), at::kCPU, fsdp);
        std::multiset<std::string> got(calls.begin(), calls.end()), want;
        for (int step = 0; step < c.steps; ++step) want.insert(expected_calls.begin(), expected_calls.end());
        EXPECT_EQ(got, want) << "every unit's reducer once per step, with 2 rows of its padded gradients";
        auto counted_full = on_cpu(fsdp.full_parameters());
        if (comm.rank() == 0) {
          plain_finals = plain_full;
          counted_finals = counted_full;
        }

        Options none;
        none.reducer = [](const ReducerRequest&) { return std::shared_ptr<GradientReducer>(); };
        auto untouched = make_model(c, at::kCPU);
        {  // each rank's own values: a broadcast before the failing check would show
          at::NoGradGuard no_grad;
          for (auto& p : untouched->parameters()) p.add_(static_cast<double>(comm.rank()));
        }
        const at::Tensor first = untouched->parameters().front();
        const at::Tensor before = first.detach().clone();
        try {
          FullyShardedModel broken(untouched, comm, none);
          ADD_FAILURE() << "a factory that gives no reducer was accepted";
        } catch (const std::invalid_argument& e) {
          const std::string what = e.what();
          std::cout << "null reducer: " << what << "\n";
          EXPECT_NE(what.find("no reducer for unit"), std::string::npos) << what;
        }
        EXPECT_TRUE(at::equal(first, before)) << "the failed construction changed no parameter";
      },
      test_group());
  const double diff = max_abs_diff(counted_finals, plain_finals);
  std::cout << "wrapped reducer vs the default: max |param diff| = " << diff << "\n";
  EXPECT_EQ(diff, 0) << "a reducer that wraps the default one computes what the default computes";
  try {
    hook_reducers("allreduce");
    ADD_FAILURE() << "the all-reduce hook has no reduce-scatter form, yet it was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected reduce_scatter, fp16 or bf16"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlab::fsdp
