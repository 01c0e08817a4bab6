// Stage 04, task 4 — FSDP on units: N ranks (threads, real Gloo) train exactly like one device, with B+1
// all-gathers in forward, B in backward and B+1 reduce-scatters per step, units freed between uses, and the
// measured memory peak equal to the layout's accounting.
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/core/model/grad_clip.h"
#include "shardlab/core/storage/flat_storage.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/clipping.h"
#include "support/device.h"
#include "support/failing_backend.h"
#include "support/fsdp_case.h"
#include "support/refusal.h"
#include "support/train_replica.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <string>

namespace shardlab::fsdp {
namespace {

constexpr double kRtol = 1e-5, kAtol = 1e-6;

using test_support::on_cpu;
using test_support::test_group;

using Case = test_support::FsdpCase;

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, MatchesSingleDeviceReference) {
  const Case& e = GetParam();
  TrainConfig c;
  c.model = e.model;
  c.optimizer = e.optimizer;
  c.lr = e.optimizer == "adamw" ? 1e-2 : 0.05;
  c.steps = 4;
  c.global_batch = 12 % (e.world * e.micro) == 0 ? 12 : 4 * e.world * e.micro;
  c.micro_batches = e.micro;
  c.seed = 13;
  c.device = test_support::device_name();
  Options options;
  options.reshard_after_forward = e.raf;
  options.allow_unused_parameters = e.model == "edge";  // `sometimes` has no gradient on odd steps
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> finals(e.world);
  run_ranks(
      e.world,
      [&](Communicator& comm) {
        auto model = make_model(c, device_of(c));
        FullyShardedModel fsdp(model, comm, options);
        test_support::train_steps(comm, c, fsdp.parameters(), device_of(c), fsdp);
        finals[comm.rank()] = on_cpu(fsdp.full_parameters());
      },
      test_group());
  for (int r = 0; r < e.world; ++r) {
    const double diff = max_abs_diff(finals[r], ref.params);
    std::cout << e << " rank " << r << ": max |param - reference| = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << "rank " << r << " max diff " << diff;
  }
}

std::vector<Case> cases() {
  // tiny GPT with SGD: see Note [Comparing with one device] in common/course/src/reference.cpp.
  return {{"tiny_gpt", "sgd", 2, 1, true}, {"tiny_gpt", "sgd", 3, 2, false}, {"tiny_gpt", "sgd", 4, 1, true},
          {"mlp", "sgd", 1, 1, true},      {"mlp", "adamw", 2, 1, true},     {"mlp", "adamw", 3, 3, true},
          {"mlp", "sgd", 4, 2, false},     {"edge", "sgd", 2, 1, true},      {"edge", "adamw", 3, 2, false},
          {"edge", "sgd", 4, 1, true}};
}

INSTANTIATE_TEST_SUITE_P(Stage04, Equivalence, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::ostringstream s;
  s << info.param;
  return s.str();
});

// Records of one phase, split by op.
struct Phase {
  std::vector<CollectiveRecord> all_gathers, reduce_scatters, other;
};

Phase split(const std::vector<CollectiveRecord>& records) {
  Phase p;
  for (const auto& r : records) {
    if (r.op == "all_gather")
      p.all_gathers.push_back(r);
    else if (r.op == "reduce_scatter")
      p.reduce_scatters.push_back(r);
    else
      p.other.push_back(r);
  }
  return p;
}

class Structure : public ::testing::TestWithParam<bool> {};

TEST_P(Structure, CollectivesPerStepAndUnitStorageFollowTheSchedule) {
  const bool raf = GetParam();
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 4;
  const int world = 2, blocks = static_cast<int>(c.layers);
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        Options options;
        options.reshard_after_forward = raf;
        FullyShardedModel fsdp(model, comm, options);
        ASSERT_EQ(fsdp.units().size(), static_cast<size_t>(blocks + 1)) << "one unit per block, then the root";
        ASSERT_NE(fsdp.root(), nullptr);
        auto data = make_dataset(c.model, c.seed);
        for (int step = 0; step < 2; ++step) {
          Batch b = rank_slice(data->global_batch(step, c.global_batch), comm.rank(), world);
          const size_t start = comm.recorder().size();
          at::Tensor loss = fsdp.loss(b);
          const size_t after_forward = comm.recorder().size();
          // Between uses: units freed (raf) or kept (no raf); the root stays gathered for its backward.
          for (size_t u = 0; u + 1 < fsdp.units().size(); ++u)
            EXPECT_EQ(fsdp.units()[u]->gathered_bytes(), raf ? 0 : fsdp.units()[u]->gathered_capacity_bytes())
                << fsdp.units()[u]->name() << " after forward";
          EXPECT_EQ(fsdp.root()->gathered_bytes(), fsdp.root()->gathered_capacity_bytes()) << "root after forward";
          const int64_t held_after_forward = fsdp.memory().param_bytes;
          fsdp.record_memory_samples(true);
          const int64_t backward_start = now_ns();
          loss.backward();
          fsdp.record_memory_samples(false);
          Phase forward, backward;
          {
            const auto all = comm.recorder().since(start);
            forward = split({all.begin(), all.begin() + static_cast<long>(after_forward - start)});
            backward = split({all.begin() + static_cast<long>(after_forward - start), all.end()});
          }
          std::cout << (raf ? "raf" : "keep") << " step " << step << ": forward " << forward.all_gathers.size()
                    << " all-gathers, backward " << backward.all_gathers.size() << " all-gathers and "
                    << backward.reduce_scatters.size() << " reduce-scatters\n";
          ASSERT_EQ(forward.all_gathers.size(), static_cast<size_t>(blocks + 1)) << "B+1 all-gathers in forward";
          EXPECT_TRUE(forward.reduce_scatters.empty() && forward.other.empty()) << "nothing else in forward";
          // ASSERT: the checks below index by these counts.
          ASSERT_EQ(backward.all_gathers.size(), raf ? static_cast<size_t>(blocks) : 0u)
              << "backward gathers every block again (raf) or none (kept); the root is kept";
          ASSERT_EQ(backward.reduce_scatters.size(), static_cast<size_t>(blocks + 1)) << "B+1 reduce-scatters";
          EXPECT_TRUE(backward.other.empty()) << "no other collective";
          // Sizes: the forward gathers the root first, then block 0, 1, ...; each of the unit's padded shard numel.
          for (size_t i = 0; i < forward.all_gathers.size(); ++i) {
            const FsdpUnit& unit = i == 0 ? *fsdp.root() : *fsdp.units()[i - 1];
            EXPECT_EQ(forward.all_gathers[i].numel * static_cast<int64_t>(sizeof(float)), unit.sharded_bytes())
                << "all-gather " << i << " (" << unit.name() << ")";
          }
          // Backward gathers (raf) in reverse forward order, block B-1 first, each of the block's padded shards.
          for (size_t i = 0; i < backward.all_gathers.size(); ++i) {
            const FsdpUnit& unit = *fsdp.units()[blocks - 1 - i];
            EXPECT_EQ(backward.all_gathers[i].numel * static_cast<int64_t>(sizeof(float)), unit.sharded_bytes())
                << "backward all-gather " << i << " (" << unit.name() << ")";
          }
          // Reduce-scatters in reverse forward order: block B-1 first, the root last; S rows of padded numel.
          for (size_t i = 0; i < backward.reduce_scatters.size(); ++i) {
            const FsdpUnit& unit =
                i + 1 == backward.reduce_scatters.size() ? *fsdp.root() : *fsdp.units()[blocks - 1 - i];
            EXPECT_EQ(backward.reduce_scatters[i].numel * static_cast<int64_t>(sizeof(float)),
                      world * unit.sharded_bytes())
                << "reduce-scatter " << i << " (" << unit.name() << ")";
          }
          // Kept after forward, a block is still freed at its own backward, as soon as its gradients are complete:
          // the j-th block's bytes are gone before the next unit's reduce-scatter starts (same thread, same clock),
          // not at the end of backward.
          if (!raf) {
            const int64_t block_bytes = fsdp.units()[0]->gathered_capacity_bytes();
            for (int j = 1; j <= blocks; ++j) {
              int64_t freed_at = -1;
              for (const auto& m : fsdp.memory_samples()) {
                if (m.ns >= backward_start && m.param_bytes <= held_after_forward - j * block_bytes) {
                  freed_at = m.ns;
                  break;
                }
              }
              ASSERT_GE(freed_at, 0) << "block " << blocks - j << " never freed in backward";
              EXPECT_LE(freed_at, backward.reduce_scatters[j].start_ns)
                  << "block " << blocks - j << " was freed only after the reduce-scatter of the unit after it began";
            }
          }
          // After backward: every unit sharded, no unsharded parameter or gradient storage left.
          for (const auto& unit : fsdp.units()) {
            EXPECT_EQ(unit->state(), UnitState::kSharded) << unit->name() << " is " << to_string(unit->state());
            EXPECT_EQ(unit->gathered_bytes(), 0) << unit->name();
            for (const auto& fp : unit->params()) {
              EXPECT_EQ(storage_bytes(fp.param), 0) << fp.name;
              EXPECT_FALSE(fp.param.grad().defined()) << fp.name << " keeps an unsharded gradient";
              EXPECT_TRUE(fp.sharded.grad().defined()) << fp.name;
            }
          }
          for (const auto& p : fsdp.parameters()) p.mutable_grad().zero_();
        }
      },
      test_group());
}

INSTANTIATE_TEST_SUITE_P(Stage04, Structure, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "reshard_after_forward" : "keep_after_forward"; });

TEST(FullyShardedModel, MeasuredPeakEqualsTheAccountingOfTheLayout) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 4;
  run_ranks(
      2,
      [&](Communicator& comm) {
        for (bool raf : {true, false}) {
          auto model = make_model(c, at::kCPU);
          Options options;
          options.reshard_after_forward = raf;
          FullyShardedModel fsdp(model, comm, options);
          auto data = make_dataset(c.model, c.seed);
          fsdp.reset_memory_peaks();
          fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), 2)).backward();
          const MemoryTheory t = fsdp.memory_theory();
          // The copy-out needs the all-gather buffer (S blocks of the unit's shards) beside the gathered buffer, for
          // the unit being gathered, and what the Communicator holds while it gathers (Gloo 1.13's list all-gather
          // fills a flat output of its own: Note [What the Communicator allocates]). raf: the largest such moment
          // is the root plus one block; kept: every block.
          auto gather_buffers = [&](const FsdpUnit& unit) {
            return 2 * unit.sharded_bytes() +
                   comm.all_gather_scratch_bytes(at::kFloat, unit.sharded_bytes() / 4, c10::Device(c10::kCPU));
          };
          int64_t largest_gather = 0, every_block = 0;
          for (size_t u = 0; u + 1 < fsdp.units().size(); ++u) {
            const FsdpUnit& unit = *fsdp.units()[u];
            largest_gather = std::max(largest_gather, unit.gathered_capacity_bytes() + gather_buffers(unit));
            every_block += unit.gathered_capacity_bytes();
          }
          const FsdpUnit& last = *fsdp.units()[fsdp.units().size() - 2];  // the last block gathered in forward
          const int64_t expected =
              t.sharded_param_bytes + t.root_bytes + (raf ? largest_gather : every_block + gather_buffers(last));
          const MemoryStats& m = fsdp.memory();
          if (comm.rank() == 0)
            std::cout << (raf ? "raf" : "keep") << ": peak parameter bytes measured " << m.peak_param_bytes
                      << ", theory " << t.peak_param_bytes << " (" << double(m.peak_param_bytes) / t.peak_param_bytes
                      << "x), accounting " << expected << "; gradient bytes measured " << m.peak_grad_bytes
                      << ", theory " << t.peak_grad_bytes << "\n";
          EXPECT_EQ(m.peak_param_bytes, expected);
          EXPECT_EQ(m.peak_param_bytes, t.peak_param_bytes) << "the theory counts every buffer the design holds";
          EXPECT_EQ(m.param_bytes, t.sharded_param_bytes) << "after the step only the shards are held";
          EXPECT_EQ(m.grad_bytes, t.sharded_grad_bytes) << "after the step only the sharded gradients are held";
          // Gradients, in a step whose sharded gradients are already there (zeroed in place): the theory walks the
          // backward (Note [The gradient peak, walked]) and counts the root's unsharded gradients from its start,
          // although the embedding's comes last. That is its only slack: measured <= theory <= measured + the root's.
          for (const auto& p : fsdp.parameters()) p.mutable_grad().zero_();
          fsdp.reset_memory_peaks();
          fsdp.loss(rank_slice(data->global_batch(1, c.global_batch), comm.rank(), 2)).backward();
          const int64_t root_grads = fsdp.units().back()->unsharded_grad_bytes();
          if (comm.rank() == 0)
            std::cout << "  second step: gradient bytes measured " << fsdp.memory().peak_grad_bytes << ", theory "
                      << t.peak_grad_bytes << " (the root's unsharded gradients: " << root_grads << ")\n";
          EXPECT_LE(fsdp.memory().peak_grad_bytes, t.peak_grad_bytes) << "a buffer the theory does not count";
          EXPECT_LE(t.peak_grad_bytes - fsdp.memory().peak_grad_bytes, root_grads)
              << "the theory counts more than the design holds";
          // An optimizer that drops the gradients (libtorch 2.x zero_grad sets them to None): new ones replace them
          // in the count, nothing is counted twice.
          for (const auto& p : fsdp.parameters()) p.mutable_grad().reset();
          fsdp.loss(rank_slice(data->global_batch(1, c.global_batch), comm.rank(), 2)).backward();
          EXPECT_EQ(fsdp.memory().grad_bytes, t.sharded_grad_bytes) << "after a step whose gradients were dropped";
        }
      },
      test_group());
}

// Clipping the shards by the whole model's norm (FullyShardedModel::clip_grad_norm, Note [A norm over shards]):
// one all-reduce of one double per call (SUM of |g|^p; MAX for the max norm), the same norm on every rank as the
// single device's full gradient (rtol 1e-6: the shards' gradients differ from one device's by the reductions'
// rounding), and training with a bound that binds matches the clipped single device (3 ranks: padded shards).
TEST(FullyShardedModel, ClippingJoinsTheShardsNormsInOneAllReduceAndMatchesTheClippedSingleDevice) {
  TrainConfig base;
  base.model = "tiny_gpt";
  base.steps = 3;
  base.global_batch = 6;
  base.seed = 13;
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
    for (int r = 0; r < world; ++r) {
      const double diff = max_abs_diff(finals[r], ref.params);
      std::cout << "p " << p << " rank " << r << ": max |param - clipped reference| = " << diff << "\n";
      EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << "rank " << r << " max diff " << diff;
    }
  }
}

TEST(FullyShardedModel, TheReductionIsAMeanNotASum) {
  // Both ranks see the same batch, rank r scales its loss by (r + 1): the mean gradient is 1.5x one rank's
  // unscaled gradient; a sum would be 3x (the bug FSDP2 has had on Gloo, PyTorch issue #162338).
  TrainConfig c;
  c.model = "mlp";
  c.global_batch = 4;
  auto reference = make_model(c, at::kCPU);
  auto data = make_dataset(c.model, c.seed);
  const Batch batch = data->global_batch(0, c.global_batch);
  reference->loss(batch).backward();
  std::vector<at::Tensor> expected;
  for (const auto& p : reference->parameters()) expected.push_back(p.grad() * 1.5);
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

TEST(FullyShardedModel, NoSyncAccumulatesAndReduceScattersOnlyOnTheLastMicroBatch) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 12;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        FullyShardedModel fsdp(model, comm);
        auto data = make_dataset(c.model, c.seed);
        auto micro = micro_batches(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), 2), 3);
        const size_t start = comm.recorder().size();
        for (int i = 0; i < 2; ++i) {
          auto scope = fsdp.no_sync();
          EXPECT_FALSE(fsdp.sync_enabled());
          fsdp.loss(micro[i]).backward();
        }
        const Phase accumulating = split(comm.recorder().since(start));
        EXPECT_TRUE(accumulating.reduce_scatters.empty()) << "no reduce-scatter inside no_sync";
        for (const auto& unit : fsdp.units())
          for (const auto& fp : unit->params()) {
            EXPECT_TRUE(fp.param.grad().defined()) << fp.name << ": the unsharded gradient accumulates";
            EXPECT_FALSE(fp.sharded.grad().defined()) << fp.name;
          }
        const size_t last = comm.recorder().size();
        fsdp.loss(micro[2]).backward();
        const Phase synced = split(comm.recorder().since(last));
        EXPECT_EQ(synced.reduce_scatters.size(), fsdp.units().size()) << "one reduce-scatter per unit, once";
        for (const auto& unit : fsdp.units())
          for (const auto& fp : unit->params()) EXPECT_FALSE(fp.param.grad().defined()) << fp.name;
      },
      test_group());
}

TEST(FullyShardedModel, MixedPrecisionGathersInBf16ReducesInF32AndKeepsF32Shards) {
  TrainConfig c;
  c.model = "mlp";
  c.steps = 3;
  c.global_batch = 8;
  c.micro_batches = 2;
  const ReferenceResult ref = train_reference(c);
  std::vector<at::Tensor> finals;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        Options options;
        options.mixed_precision.param_dtype = at::kBFloat16;
        options.mixed_precision.reduce_dtype = at::kFloat;
        FullyShardedModel fsdp(model, comm, options);
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

// Stage 03's hooks are FSDP's extension point: the compressed ones reduce-scatter a half-size copy (fp16 on every
// Gloo; bf16 where Gloo carries it, else as f32, and the record says so), cast back into the f32 shards, and train
// close to f32 (measured 3e-5 with fp16 and 4e-4 with bf16 after 3 steps: the gradients' rounding, nothing else).
TEST(FullyShardedModel, CompressedHooksReduceScatterInTheirDtypeAndTrainCloseToF32) {
  TrainConfig c;
  c.model = "mlp";
  c.steps = 3;
  c.global_batch = 8;
  const ReferenceResult ref = train_reference(c);
  for (const std::string hook : {"fp16", "bf16"}) {
    const c10::ScalarType dtype = hook == "fp16" ? at::kHalf : at::kBFloat16;
    const c10::ScalarType wire = dtype == at::kBFloat16 && !compat::gloo_features().bfloat16 ? at::kFloat : dtype;
    std::vector<at::Tensor> finals;
    run_ranks(
        2,
        [&](Communicator& comm) {
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
    const double diff = max_abs_diff(finals, ref.params);
    std::cout << hook << " hook vs the f32 reference: max |param diff| = " << diff << "\n";
    EXPECT_LT(diff, 2e-3) << hook;
    EXPECT_GT(diff, 0) << hook << ": a half-size reduction cannot be bit-identical to f32";
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
  TrainConfig c;
  c.model = "tiny_gpt";
  c.steps = 2;
  c.global_batch = 8;
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
          EXPECT_EQ(request.shard_group, &comm) << request.unit << ": the unit is sharded over the wrapper's group";
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
  Batch global;
  global.input = at::linspace(-1.0, 1.0, 16).reshape({4, 4});
  global.target = at::zeros({4}, at::kLong);
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
    TrainConfig c;
    c.model = "mlp";
    c.steps = 3;
    c.global_batch = 8;
    c.micro_batches = micro;
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
            Options options;
            options.mixed_precision.param_dtype = at::kBFloat16;
            options.mixed_precision.reduce_dtype = at::kFloat;
            FullyShardedModel fsdp(model, comm, options);
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

TEST(FullyShardedModel, AnUnusedParameterIsAnErrorNamingItAndNoRankHangs) {
  TrainConfig c;
  c.model = "edge";
  c.global_batch = 4;
  std::vector<std::string> errors(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        FullyShardedModel fsdp(model, comm);
        auto data = make_dataset(c.model, c.seed);
        fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), 2)).backward();  // even: all used
        try {
          fsdp.loss(rank_slice(data->global_batch(1, c.global_batch), comm.rank(), 2)).backward();  // odd: unused
        } catch (const std::runtime_error& e) {
          errors[comm.rank()] = e.what();
        }
        // The wrapper is still usable: the next (even) step trains.
        fsdp.loss(rank_slice(data->global_batch(2, c.global_batch), comm.rank(), 2)).backward();
      },
      test_group());
  for (const auto& e : errors) EXPECT_NE(e.find("'sometimes'"), std::string::npos) << "got: " << e;
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
  std::vector<at::Tensor> ref_grads;
  for (const auto& p : reference.parameters()) ref_grads.push_back(p.grad().clone());

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
          for (const auto& p : fsdp.parameters()) grads[comm.rank()].push_back(p.grad().clone());
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

// Note [A wrapper whose all-gather failed]: the second all-gather of the first forward fails on both ranks
// (test_support::FailingBackend). loss() throws that error; from then on every call that would gather, compute or
// save refuses with std::logic_error naming the unit and the first error, and sends nothing.
TEST(FullyShardedModel, AfterAFailedAllGatherTheWrapperRefusesFurtherUseAndSendsNothing) {
  GroupOptions options = test_group();
  options.wrap_backend = [](c10::intrusive_ptr<compat::Backend> inner, int) {
    return c10::make_intrusive<test_support::FailingBackend>(std::move(inner), std::set<int>{}, std::set<int>{2});
  };
  std::vector<std::string> first(2), refusals(2);
  std::vector<int> refused(2, 0);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model("mlp", 7);
        FullyShardedModel fsdp(model, comm);
        comm.set_all_gather_algorithm(AllGatherAlgorithm::kBackend);  // the backend's, where the failure is
        auto data = make_dataset("mlp", 7);
        const Batch batch = rank_slice(data->global_batch(0, 8), comm.rank(), 2);
        try {
          fsdp.loss(batch).backward();
          ADD_FAILURE() << "the failed all-gather was not reported";
        } catch (const std::runtime_error& e) {
          first[comm.rank()] = e.what();
        }
        const size_t sent = comm.recorder().size();
        const std::string dir = ::testing::TempDir() + "fsdp_refused_" + std::to_string(comm.rank());
        const std::vector<std::function<void()>> calls{[&] { fsdp.loss(batch); },
                                                       [&] { fsdp.full_parameters(); },
                                                       [&] { fsdp.full_state_dict(); },
                                                       [&] { fsdp.clip_grad_norm(1.0); },
                                                       [&] { fsdp.save_checkpoint(dir, nullptr); },
                                                       [&] { fsdp.begin_unshard(0); }};
        for (const auto& call : calls) {
          try {
            call();
          } catch (const std::invalid_argument& e) {  // a logic_error too, but not this refusal
            refusals[comm.rank()] += std::string("\n  (not the refusal) ") + e.what();
          } catch (const std::logic_error& e) {
            const std::string m = e.what();
            if (m.find("refused, since the all-gather of unit '") != std::string::npos) ++refused[comm.rank()];
            refusals[comm.rank()] += "\n  " + m;
          }
        }
        EXPECT_EQ(comm.recorder().size(), sent) << "a refused call sent something";
      },
      options);
  for (int r = 0; r < 2; ++r) {
    std::cout << "rank " << r << ": first '" << first[r] << "'\n then:" << refusals[r] << "\n";
    EXPECT_NE(first[r].find(test_support::FailingBackend::kAllGatherMessage), std::string::npos) << first[r];
    EXPECT_EQ(refused[r], 6) << "rank " << r << ": every call must be refused, naming the failed unit:" << refusals[r];
    EXPECT_NE(refusals[r].find("unit '"), std::string::npos) << refusals[r];
    EXPECT_NE(refusals[r].find(test_support::FailingBackend::kAllGatherMessage), std::string::npos) << refusals[r];
    EXPECT_NE(refusals[r].find("new group and wrapper"), std::string::npos) << refusals[r];
  }
}

// A backward that throws halfway (here: a hook on block 0's output, after the later blocks' gradients came) must
// leave nothing behind: the next step, after the optimizer's zero_grad, gives the same gradients as a clean one.
TEST(FullyShardedModel, ABackwardThatThrowsLeavesNothingForTheNextStep) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 4;
  std::vector<std::vector<at::Tensor>> clean(2), after_abort(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto data = make_dataset(c.model, c.seed);
        for (bool abort : {false, true}) {
          auto model = make_model(c, at::kCPU);
          FullyShardedModel fsdp(model, comm);
          if (abort) {
            UnitForward fsdp_slot = model->units()[0].forward;
            model->units()[0].forward = [fsdp_slot](const at::Tensor& x) {
              at::Tensor y = fsdp_slot(x);
              y.register_hook([](const at::Tensor&) { throw std::runtime_error("injected failure in backward"); });
              return y;
            };
            EXPECT_THROW(fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), 2)).backward(),
                         std::exception);
            model->units()[0].forward = fsdp_slot;
            for (const auto& p : fsdp.parameters())
              if (p.grad().defined()) p.mutable_grad().zero_();  // the optimizer's zero_grad before the next step
          }
          fsdp.loss(rank_slice(data->global_batch(1, c.global_batch), comm.rank(), 2)).backward();
          std::vector<at::Tensor> grads;
          for (const auto& p : fsdp.parameters()) grads.push_back(p.grad().clone());
          (abort ? after_abort : clean)[comm.rank()] = grads;
          for (const auto& unit : fsdp.units())
            for (const auto& fp : unit->params()) EXPECT_FALSE(fp.param.grad().defined()) << fp.name;
        }
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    const double diff = max_abs_diff(after_abort[r], clean[r]);
    std::cout << "rank " << r << ": max |grad after an aborted backward - clean grad| = " << diff << "\n";
    EXPECT_EQ(diff, 0.0);
  }
}

// Note [When a unit may be freed in backward] says a unit with a frozen parameter must stay gathered until the end of
// backward, because the frozen parameter's backward node can run after the trainable gradients are all in. This
// unit computes frozen(x) + fc(x): autograd runs fc's node first (made later), fc's gradients complete the unit, and
// only then does frozen's node compute the input's gradient from the frozen weight. Freed early, the unit would hand
// that node a weight without storage: this test must fail (wrong values or a crash) when `has_frozen()` is ignored.
TEST(FullyShardedModel, AUnitWithAFrozenParameterStaysGatheredUntilItsFrozenNodeHasRun) {
  struct Mix : torch::nn::Module {
    Mix()
        : frozen(register_module("frozen", torch::nn::Linear(8, 8))),
          fc(register_module("fc", torch::nn::Linear(8, 8))) {
      for (auto& p : frozen->parameters()) p.requires_grad_(false);
    }
    // The hook on frozen(x) runs as the frozen node is about to compute: its weight must hold its values then.
    at::Tensor forward(const at::Tensor& x) {
      at::Tensor a = frozen->forward(x);
      if (a.requires_grad()) {
        const at::Tensor w = frozen->weight;
        std::atomic<int64_t>* least = &least_bytes_at_frozen_node;
        a.register_hook([w, least](const at::Tensor&) { *least = std::min<int64_t>(*least, storage_bytes(w)); });
      }
      return a + fc->forward(x);
    }
    torch::nn::Linear frozen, fc;
    std::atomic<int64_t> least_bytes_at_frozen_node{INT64_MAX};
  };
  struct Net : Model {
    Net() {
      in = register_module("in", torch::nn::Linear(16, 8));
      mix = register_unit("mix", std::make_shared<Mix>());
      head = register_module("head", torch::nn::Linear(8, 4));
      init_parameters(*this, 5);
      for (auto& p : mix->frozen->parameters()) p.requires_grad_(false);
    }
    at::Tensor loss(const Batch& b) override {
      return at::cross_entropy_loss(head->forward(mix(at::tanh(in->forward(b.input)))), b.target);
    }
    torch::nn::Linear in{nullptr}, head{nullptr};
    UnitRef<Mix> mix;
  };
  auto data = make_dataset("mlp", 4);
  const int steps = 2, world = 2, batch = 8;
  auto reference = std::make_shared<Net>();
  auto ref_opt = make_optimizer("sgd", trainable_parameters(*reference), 0.1);
  for (int step = 0; step < steps; ++step) {
    ref_opt->zero_grad();
    reference->loss(data->global_batch(step, batch)).backward();
    ref_opt->step();
  }
  std::vector<std::vector<at::Tensor>> finals(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = std::make_shared<Net>();
        FullyShardedModel fsdp(model, comm);
        ASSERT_TRUE(fsdp.units()[0]->has_frozen());
        auto opt = make_optimizer("sgd", fsdp.parameters(), 0.1);
        for (int step = 0; step < steps; ++step) {
          opt->zero_grad();
          try {
            fsdp.loss(rank_slice(data->global_batch(step, batch), comm.rank(), world)).backward();
          } catch (const std::exception& e) {
            ADD_FAILURE() << "rank " << comm.rank() << " step " << step << ": backward threw (" << e.what()
                          << "); the frozen weight held " << model->mix->least_bytes_at_frozen_node
                          << " bytes when its backward node ran: the unit was freed before its backward was done "
                             "(Note [When a unit may be freed in backward])";
            return;
          }
          EXPECT_EQ(fsdp.units()[0]->state(), UnitState::kSharded)
              << "rank " << comm.rank() << " step " << step << ": the unit is " << to_string(fsdp.units()[0]->state())
              << " after backward; a unit kept gathered for its frozen parameter is freed at the end of backward";
          opt->step();
        }
        const int64_t least = model->mix->least_bytes_at_frozen_node;
        EXPECT_EQ(least, fsdp.units()[0]->gathered_capacity_bytes())
            << "rank " << comm.rank() << ": the frozen weight held " << least
            << " bytes when its backward node ran; the unit was freed before its backward was done";
        finals[comm.rank()] = on_cpu(fsdp.full_parameters());
      },
      test_group());
  for (int r = 0; r < world; ++r) {
    if (finals[r].empty()) continue;  // its backward failed, reported above
    const double diff = max_abs_diff(finals[r], on_cpu(reference->parameters()));
    std::cout << "rank " << r << ": max |param - one device| with a frozen parameter in the unit = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], on_cpu(reference->parameters()), kRtol, kAtol)) << "max diff " << diff;
  }
}

// A unit that notes how many bytes its weight holds when its forward runs, and when its backward reaches it (a hook
// on an inner tensor runs after FSDP's hook on the unit's output, just before the unit's own backward nodes). Its
// input needs no gradient, so its backward never reads the weight: a unit left sharded shows here as 0 bytes, not as
// a read of freed memory.
struct Probe : torch::nn::Module {
  Probe() : fc(register_module("fc", torch::nn::Linear(6, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    forward_bytes = storage_bytes(fc->weight);
    if (forward_bytes == 0)
      throw std::runtime_error("the unit's forward found its weight at 0 bytes: it must be gathered before it runs");
    at::Tensor inner = fc->forward(x);
    if (inner.requires_grad()) {
      const at::Tensor w = fc->weight;
      std::atomic<int64_t>* seen = &backward_bytes;
      inner.register_hook([w, seen](const at::Tensor&) { *seen = storage_bytes(w); });
    }
    return at::tanh(inner);
  }
  torch::nn::Linear fc;
  int64_t forward_bytes = -1;
  std::atomic<int64_t> backward_bytes{-1};
};

TEST(FullyShardedModel, AUnitIsGatheredWhileItsForwardAndItsBackwardRun) {
  struct OneUnit : Model {
    OneUnit() {
      probe = register_unit("probe", std::make_shared<Probe>());
      init_parameters(*this, 9);
    }
    at::Tensor loss(const Batch& b) override { return probe(b.input).pow(2).mean(); }
    UnitRef<Probe> probe;
  };
  Batch global;
  global.input = at::linspace(-1.0, 1.0, 24).reshape({4, 6});
  global.target = at::zeros({4}, at::kLong);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<OneUnit>();
        FullyShardedModel fsdp(model, comm);  // reshard after forward: gathered again for its backward
        ASSERT_EQ(fsdp.root(), nullptr);
        const FsdpUnit& unit = *fsdp.units()[0];
        for (int step = 0; step < 2; ++step) {
          try {
            at::Tensor loss = fsdp.loss(rank_slice(global, comm.rank(), comm.size()));
            EXPECT_EQ(model->probe->forward_bytes, unit.gathered_capacity_bytes()) << "step " << step;
            loss.backward();
          } catch (const std::exception& e) {
            ADD_FAILURE() << "rank " << comm.rank() << " step " << step << ": " << e.what();
            return;
          }
          EXPECT_EQ(model->probe->backward_bytes.load(), unit.gathered_capacity_bytes())
              << "rank " << comm.rank() << " step " << step << ": the unit's weight held "
              << model->probe->backward_bytes.load() << " bytes when its backward ran; expected "
              << unit.gathered_capacity_bytes()
              << ": a unit freed after its forward is gathered again before its backward (pre_backward, from a "
                 "hook on the unit's output)";
          EXPECT_EQ(unit.state(), UnitState::kSharded) << "and freed after it";
          for (const auto& p : fsdp.parameters()) p.mutable_grad().zero_();
        }
      },
      test_group());
}

// Three units in a chain; the middle one has a parameter the loss reads only when `use_extra` is set. Without it the
// middle unit's gradients never all come: the end of backward settles it.
struct MaybeUsed : torch::nn::Module {
  MaybeUsed() : fc(register_module("fc", torch::nn::Linear(6, 6))) {
    extra = register_parameter("extra", at::zeros({6}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor y = fc->forward(x);
    return use_extra ? y + extra : y;
  }
  torch::nn::Linear fc;
  at::Tensor extra;
  bool use_extra = true;
};

struct Chain : Model {
  Chain() {
    first = register_unit("first", torch::nn::Linear(4, 6).ptr());
    middle = register_unit("middle", std::make_shared<MaybeUsed>());
    last = register_unit("last", torch::nn::Linear(6, 3).ptr());
    init_parameters(*this, 11);
  }
  at::Tensor loss(const Batch& b) override { return last(at::tanh(middle(at::tanh(first(b.input))))).pow(2).mean(); }
  UnitRef<torch::nn::LinearImpl> first;
  UnitRef<MaybeUsed> middle;
  UnitRef<torch::nn::LinearImpl> last;
};

Batch chain_batch() {
  Batch b;
  b.input = at::linspace(-1.0, 1.0, 16).reshape({4, 4});
  b.target = at::zeros({4}, at::kLong);
  return b;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return "[" + out + "]";
}

// 'first' is complete before 'middle', whose 'extra' never gets a gradient; a rank that launched whatever is
// complete would send first's reduce-scatter where another rank (where 'extra' was used) sends middle's.
TEST(FullyShardedModel, ReduceScattersLaunchInReverseForwardOrderEvenWhenAUnitIsSettledAtTheEnd) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Chain>();
        model->middle->use_extra = false;
        Options options;
        options.allow_unused_parameters = true;
        FullyShardedModel fsdp(model, comm, options);
        ASSERT_EQ(fsdp.units().size(), 3u) << "three units, no root";
        std::vector<std::string> launched;
        fsdp.set_observer([&](const UnitEvent& e) {
          if (e.kind == UnitEventKind::kReduceLaunched) launched.push_back(fsdp.units()[e.unit]->name());
        });
        const size_t mark = comm.recorder().size();
        fsdp.loss(rank_slice(chain_batch(), comm.rank(), comm.size())).backward();
        fsdp.set_observer({});
        const std::vector<std::string> expected{"last", "middle", "first"};
        EXPECT_EQ(launched, expected)
            << "rank " << comm.rank() << ": reduce-scatters are launched in reverse forward order " << joined(expected)
            << ", a complete unit waiting for the units before it (Note [Reduce-scatters in one "
            << "order on every rank]); got " << joined(launched);
        EXPECT_EQ(split(comm.recorder().since(mark)).reduce_scatters.size(), 3u) << "one reduce-scatter per unit";
      },
      test_group());
}

TEST(FullyShardedModel, AtMostOneReduceScatterIsInFlight) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 4;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        FullyShardedModel fsdp(model, comm);
        auto data = make_dataset(c.model, c.seed);
        std::vector<std::string> in_flight;  // units whose reduction was launched and has not landed
        size_t launches = 0;
        fsdp.set_observer([&](const UnitEvent& e) {
          const std::string& name = fsdp.units()[e.unit]->name();
          if (e.kind == UnitEventKind::kReduceLaunched) {
            EXPECT_TRUE(in_flight.empty()) << "rank " << comm.rank() << ": '" << name
                                           << "' launched its reduce-scatter while " << joined(in_flight)
                                           << " still in flight (launched, not waited for); wait for the "
                                              "previous one first (Note [One reduce-scatter in flight])";
            ++launches;
          }
          if (e.kind == UnitEventKind::kReduceLanded)
            in_flight.erase(std::remove(in_flight.begin(), in_flight.end(), name), in_flight.end());
          if (e.kind == UnitEventKind::kReduceLaunched) in_flight.push_back(name);
        });
        fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), 2)).backward();
        fsdp.set_observer({});
        EXPECT_EQ(launches, fsdp.units().size());
        EXPECT_TRUE(in_flight.empty()) << "every reduction waited for by the end of backward: " << joined(in_flight);
      },
      test_group());
}

// Inside no_sync with a reduce dtype wider than the param dtype, a unit's gradients move into reduce-dtype
// accumulators (stash_gradients) once the unit is done, and those of a unit whose gradients never all came at the
// end of backward: micro-batches then add up in float, not in bfloat16.
TEST(FullyShardedModel, InsideNoSyncEveryUnitsGradientsAreStashedInTheReduceDtype) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Chain>();
        model->middle->use_extra = false;
        Options options;
        options.allow_unused_parameters = true;
        options.mixed_precision.param_dtype = at::kBFloat16;
        options.mixed_precision.reduce_dtype = at::kFloat;
        FullyShardedModel fsdp(model, comm, options);
        const Batch batch = rank_slice(chain_batch(), comm.rank(), comm.size());
        {
          auto scope = fsdp.no_sync();
          fsdp.loss(batch).backward();
        }
        for (const auto& unit : fsdp.units())
          for (const auto& fp : unit->params())
            EXPECT_FALSE(fp.param.grad().defined())
                << "rank " << comm.rank() << ", " << fp.name << ": inside no_sync (param dtype bfloat16, reduce dtype "
                << "float) its unsharded gradient is still a " << c10::toString(fp.param.grad().scalar_type())
                << " .grad(); expected it moved into a float accumulator (stash_gradients) "
                << (unit->name() == "middle" ? "at the end of backward ('extra' got no gradient)"
                                             : "when its unit's gradients were complete");
        fsdp.loss(batch).backward();  // the synchronized micro-batch reduces what was stashed
        for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
      },
      test_group());
}

// A user's model whose rank 1 builds its first layer a row or two larger than the other ranks' (at world size 3,
// [3, 7] against [2, 7] pads to the same shard size, so FSDP trained on silently; [4, 7] made the first all-gather
// fail on Gloo's thread and abort the process). The ranks' structures are compared before anything else is issued
// (Note [Comparing the ranks' models], through broadcast_state): every rank throws the same error naming the
// parameter, the ranks and both shapes, and only the check's own all-gathers ran. The equal case trains a step.
TEST(FullyShardedModel, ARankWhoseModelDiffersIsStoppedAtConstructionOnEveryRank) {
  struct UserNet : Model {
    explicit UserNet(int64_t rows) {
      block = register_unit("block", torch::nn::Linear(7, rows).ptr());
      head = register_module("head", torch::nn::Linear(rows, 2));
    }
    at::Tensor loss(const Batch& b) override { return head->forward(block(b.input)).pow(2).mean(); }
    UnitRef<torch::nn::LinearImpl> block;
    torch::nn::Linear head{nullptr};
  };
  const int world = 3;
  run_ranks(
      world,
      [&](Communicator& comm) {
        FullyShardedModel fsdp(std::make_shared<UserNet>(2), comm);
        Batch b;
        b.input = at::ones({2, 7});
        b.target = at::zeros({2}, at::kLong);
        fsdp.loss(b).backward();
      },
      test_group());
  for (const int64_t extra : {1, 2}) {
    SCOPED_TRACE("rank 1's block has " + std::to_string(extra) + " more row(s)");
    std::vector<test_support::Refusal> seen(world);
    run_ranks(
        world,
        [&](Communicator& comm) {
          auto model = std::make_shared<UserNet>(comm.rank() == 1 ? 2 + extra : 2);
          seen[comm.rank()] = test_support::refusal_of(comm, [&] { FullyShardedModel fsdp(model, comm); });
          for (const auto& p : model->parameters())
            EXPECT_GT(storage_bytes(p), 0) << "the model must be left as it was";
        },
        test_group());
    test_support::expect_same_refusal(
        seen, {"'block.weight'", "sizes [" + std::to_string(2 + extra) + ", 7]", "sizes [2, 7]", "rank 1 has"});
  }
}

TEST(FullyShardedModel, AParameterSharedBetweenAUnitAndTheRootIsRejectedAndTheFixItNamesTrains) {
  // A block that also registers the root's embedding: the root's use would read the block's freed storage.
  struct UsesShared : torch::nn::Module {
    explicit UsesShared(const at::Tensor& shared) { w = register_parameter("w", shared); }
    at::Tensor forward(const at::Tensor& x) { return at::matmul(x, w.t()); }
    at::Tensor w;
  };
  // `in_unit`: the block is a unit (rejected); otherwise it stays in the root, the fix the error advises.
  struct Tied : Model {
    explicit Tied(bool in_unit, uint64_t seed = 1) {
      emb = register_module("emb", torch::nn::Linear(4, 4));
      auto shared = std::make_shared<UsesShared>(emb->weight);
      if (in_unit)
        block = register_unit("block", shared);
      else
        plain = register_module("block", shared);
      init_parameters(*this, seed);
    }
    at::Tensor loss(const Batch& b) override {
      const at::Tensor h = emb->forward(b.input);
      return (plain ? plain->forward(h) : block(h)).pow(2).mean();
    }
    torch::nn::Linear emb{nullptr};
    UnitRef<UsesShared> block;
    std::shared_ptr<UsesShared> plain;
  };
  // Two ranks whose models differ: a rejected model keeps its own values (nothing was broadcast before the check).
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Tied>(/*in_unit=*/true, /*seed=*/1 + comm.rank());
        const at::Tensor before = model->emb->weight.detach().clone();
        try {
          FullyShardedModel fsdp(model, comm);
          ADD_FAILURE() << "a parameter in a unit and in the root was accepted";
        } catch (const std::invalid_argument& e) {
          std::cout << "error: " << e.what() << "\n";
          EXPECT_NE(std::string(e.what()).find("emb.weight"), std::string::npos) << e.what();
        }
        for (const auto& p : model->parameters()) EXPECT_GT(storage_bytes(p), 0) << "the model must be left as it was";
        EXPECT_TRUE(at::equal(model->emb->weight, before))
            << "rank " << comm.rank() << ": max |change| " << (model->emb->weight - before).abs().max().item<float>();
      },
      test_group());

  // The fix: the shared module in the root. Two ranks, one SGD step, against one device on the union batch.
  Batch global;
  global.input = at::linspace(-1.0, 1.0, 16).reshape({4, 4});
  global.target = at::zeros({4}, at::kLong);            // unused by this loss; rank_slice slices it too
  auto sgd_step = [](std::vector<at::Tensor> params) {  // each tensor once: the reference lists the tied one twice
    torch::NoGradGuard no_grad;
    std::set<const c10::TensorImpl*> done;
    for (auto& p : params)
      if (done.insert(p.unsafeGetTensorImpl()).second) p.sub_(p.grad() * 0.5);
  };
  auto ref = std::make_shared<Tied>(/*in_unit=*/false);
  ref->loss(global).backward();
  sgd_step(ref->parameters());
  std::vector<std::vector<at::Tensor>> finals(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = std::make_shared<Tied>(/*in_unit=*/false);
        FullyShardedModel fsdp(model, comm);
        fsdp.loss(rank_slice(global, comm.rank(), comm.size())).backward();
        sgd_step(fsdp.parameters());
        finals[comm.rank()] = on_cpu(fsdp.full_parameters());
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    const double diff = max_abs_diff(finals[r], on_cpu(ref->parameters()));
    std::cout << "shared module in the root, rank " << r << ": max |param - reference| = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], on_cpu(ref->parameters()), kRtol, kAtol)) << "rank " << r << " diff " << diff;
  }
}

TEST(FullyShardedModel, EvaluationGathersAndFreesWithoutBackward) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 4;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(c, at::kCPU);
        Options options;
        options.reshard_after_forward = false;
        FullyShardedModel fsdp(model, comm, options);
        auto data = make_dataset(c.model, c.seed);
        torch::NoGradGuard no_grad;
        const double loss = fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), comm.rank(), 2)).item<double>();
        EXPECT_GT(loss, 0);
        for (const auto& unit : fsdp.units()) EXPECT_EQ(unit->gathered_bytes(), 0) << unit->name();
      },
      test_group());
}

}  // namespace
}  // namespace shardlab::fsdp
