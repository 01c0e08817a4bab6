// Stage 06 — HSDP's accumulation and memory on a 2-D mesh, ranks as threads over one store: the all-reduce deferred
// over micro-batches (reduce-scatters every micro-batch, one all-reduce per unit per step), no partial left by a
// backward that throws, deferring refused on stage 04's FSDP, and the measured gradient peak within the theory.
#include "shardlab/hsdp/hsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/gradients.h"
#include "support/group.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>

namespace shardlab::hsdp {
namespace {

using fsdp::FullyShardedModel;
using namespace test_support;  // tests/support: the rank loops, builders and checks

// Bytes every unit's HsdpReducer holds in its partial (deferred micro-batches).
int64_t partial_bytes(const FullyShardedModel& fsdp) {
  int64_t bytes = 0;
  for (const auto& unit : fsdp.units()) bytes += dynamic_cast<const HsdpReducer&>(unit->reducer()).partial_bytes();
  return bytes;
}

// ---- Task 3: accumulation that defers the all-reduce ------------------------------------------------------------

// k = 3 micro-batches per step, 2 steps, 2x2. Deferred (set_requires_all_reduce false on the first two): per unit
// per step 3 reduce-scatters and 1 all-reduce, the partial held between micro-batches and gone after the step, every
// rank within rtol 1e-5 of one device, shards bit-identical across replicas; the same deferred with fp16 on the wire
// (the partial kept in f32) within 2e-3. no_sync on the first two instead: one reduce-scatter and one all-reduce per
// unit per step, both on the last micro-batch.
TEST(HsdpAccumulation, DeferredAllReduceReduceScattersEveryMicroBatchAndAllReducesOnce) {
  TrainConfig c = test_support::config("mlp").steps(2).global_batch(24).micro_batches(3);
  const ReferenceResult ref = train_reference(c);
  for (const std::string mode : {"deferred", "no_sync", "deferred_fp16"}) {
    const bool fp16 = mode == "deferred_fp16", deferred = mode != "no_sync";
    std::vector<std::vector<at::Tensor>> finals(4);
    run_world(
        4,
        [&](World& world) {
          Mesh mesh(world, 2, 2);
          auto model = make_model(c, at::kCPU);
          auto fsdp = fully_shard_hybrid(model, mesh, {}, fp16 ? Wire::kFloat16 : Wire::kReduceDtype);
          auto data = make_dataset(c.model, c.seed);
          auto opt = make_optimizer(c.optimizer, fsdp->parameters(), c.lr);
          const size_t units = fsdp->units().size();
          for (int step = 0; step < c.steps; ++step) {
            compat::zero_grad(*opt);
            auto micro = micro_batches(rank_slice(data->global_batch(step, c.global_batch), world.rank(), 4), 3);
            for (int i = 0; i < 3; ++i) {
              const bool last = i == 2;
              const size_t mark = world.recorder().size();
              if (deferred) {
                set_requires_all_reduce(*fsdp, last);
                (fsdp->loss(micro[i]) / 3.0).backward();
              } else if (last) {
                (fsdp->loss(micro[i]) / 3.0).backward();
              } else {
                auto scope = fsdp->no_sync();
                (fsdp->loss(micro[i]) / 3.0).backward();
              }
              size_t rs = 0, ar = 0;
              for (const auto& r : world.recorder().since(mark)) {
                rs += r.op == "reduce_scatter" ? 1 : 0;
                ar += r.op == "all_reduce" ? 1 : 0;
              }
              const size_t want_rs = deferred || last ? units : 0, want_ar = last ? units : 0;
              EXPECT_EQ(rs, want_rs) << mode << " step " << step << " micro-batch " << i << ": reduce-scatters";
              EXPECT_EQ(ar, want_ar) << mode << " step " << step << " micro-batch " << i << ": all-reduces";
              const int64_t partial = partial_bytes(*fsdp);
              if (deferred && !last)
                EXPECT_GT(partial, 0) << "deferred micro-batch " << i << ": the rows wait in the partial";
              else
                EXPECT_EQ(partial, 0) << mode << " micro-batch " << i << ": no partial held";
            }
            opt->step();
          }
          finals[world.rank()] = on_cpu(fsdp->full_parameters());
        },
        test_group());
    for (int r = 0; r < 4; ++r) {
      const double diff = max_abs_diff(finals[r], ref.params);
      std::cout << mode << " rank " << r << ": max |param - one device| = " << diff << "\n";
      if (fp16)
        EXPECT_LT(diff, 2e-3) << mode << " rank " << r << ": the rows summed in f32, sent in fp16";
      else
        EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << mode << " rank " << r << " differs by " << diff;
    }
    EXPECT_EQ(max_abs_diff(finals[2], finals[0]), 0) << mode << ": the replicas of shard 0 differ";
    EXPECT_EQ(max_abs_diff(finals[3], finals[1]), 0) << mode << ": the replicas of shard 1 differ";
  }
}

// A backward that throws leaves no partial behind: after a deferred micro-batch (partial held), a deferred backward
// cut short (units already reduced, the first layer's gradient throwing) is settled by the next loss(): every
// unit's partial is dropped, the one of the good micro-batch included, as stage 04 drops unsharded gradients.
TEST(HsdpAccumulation, ABackwardThatThrowsLeavesNoPartialBehind) {
  TrainConfig c = test_support::config("mlp").global_batch(8);
  run_world(
      4,
      [&](World& world) {
        Mesh mesh(world, 2, 2);
        auto model = make_model(c, at::kCPU);
        auto fsdp = fully_shard_hybrid(model, mesh);
        auto data = make_dataset(c.model, c.seed);
        const Batch mine = rank_slice(data->global_batch(0, c.global_batch), world.rank(), 4);
        set_requires_all_reduce(*fsdp, false);
        fsdp->loss(mine).backward();
        EXPECT_GT(partial_bytes(*fsdp), 0) << "a deferred micro-batch holds its rows";
        at::Tensor loss = fsdp->loss(mine);
        ASSERT_TRUE(test_support::backward_cut_short_at(model->parameters().front(), [&] { loss.backward(); }));
        fsdp->loss(mine);  // settles the backward that threw
        EXPECT_EQ(partial_bytes(*fsdp), 0) << "the partial of a step whose backward threw must not reach a later step";
        set_requires_all_reduce(*fsdp, true);
      },
      test_group());
}

// set_requires_all_reduce is for HSDP wrappers: on stage 04's FSDP it is an error naming the unit and its reducer.
// It reaches the reducers through the switch the wrapper offers (its ReplicaSync facet): fully_shard_hybrid attaches
// one; a wrapper built by hand gets one by attaching the switch its reducers were made with, and without it is refused
// with a message that says how.
TEST(HsdpAccumulation, DeferringOnAWrapperThatIsNotHsdpIsAnError) {
  TrainConfig c = test_support::config("mlp");
  run_world(
      2,
      [&](World& world) {
        Mesh mesh(world, 2, 1);
        auto hybrid = fully_shard_hybrid(make_model(c, at::kCPU), mesh);
        set_requires_all_reduce(*hybrid, false);  // an HSDP wrapper takes it
        set_requires_all_reduce(*hybrid, true);
        FullyShardedModel plain(make_model(c, at::kCPU), world.world());
        try {
          set_requires_all_reduce(plain, false);
          ADD_FAILURE() << "stage 04's FSDP accepted set_requires_all_reduce";
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("reduce_scatter"), std::string::npos) << e.what();
        }
        // By hand, as fully_shard_hybrid builds it: the switch reaches every unit's reducer once attached.
        auto sync = std::make_shared<HsdpSwitch>();
        fsdp::Options options;
        options.reducer = hsdp_reducers(Wire::kReduceDtype, sync);
        FullyShardedModel by_hand(make_model(c, at::kCPU), mesh_info(mesh), options);
        EXPECT_EQ(sync->size(), by_hand.units().size()) << "one HsdpReducer per unit in the switch";
        try {
          set_requires_all_reduce(by_hand, false);
          ADD_FAILURE() << "a wrapper without a switch accepted set_requires_all_reduce";
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("attach<ReplicaSync>(sync)"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("'hsdp'"), std::string::npos) << e.what();
        }
        by_hand.attach<ReplicaSync>(sync);
        set_requires_all_reduce(by_hand, false);
        for (const auto& unit : by_hand.units())
          EXPECT_TRUE(unit->reducer().name() == "hsdp" &&
                      !static_cast<const HsdpReducer&>(unit->reducer()).requires_all_reduce())
              << "unit '" << unit->name() << "' still all-reduces after set_requires_all_reduce(false)";
        set_requires_all_reduce(by_hand, true);
      },
      test_group());
}

// ---- Memory: what a step holds, measured beside theory --------------------------------------------------------

// The meter follows each reduction phase by phase (Note [A reduction's bytes, phase by phase]): after the advance
// only the output row and the all-reduce's buffers stay, and a deferred partial is counted while held. The theory
// walks the same backward (Note [The gradient peak, walked]). As in stage 04, measured <= theory <= measured + the
// root's unsharded gradients (counted from the start of backward, although the embedding's comes last), for a plain
// step, no_sync over 2 micro-batches and the deferred all-reduce, with f32 and bf16 (Gloo 1.13 all-reduces bf16 as an
// f32 copy) on the wire. A meter that keeps each reduction's input to the end of backward (every unit's S rows at
// once) measures more than the theory; after the step the gradients are the sharded ones only.
TEST(HsdpMemory, MeasuredGradientPeakIsWithinTheTheoryOfThePhasedReduction) {
  TrainConfig c = test_support::config("tiny_gpt").global_batch(16);
  for (const std::string mode : {"sync", "no_sync", "deferred", "deferred_bf16"}) {
    const bool bf16 = mode == "deferred_bf16", deferred = mode.rfind("deferred", 0) == 0;
    const int k = mode == "sync" ? 1 : 2;
    run_world(
        4,
        [&](World& world) {
          Mesh mesh(world, 2, 2);
          auto fsdp =
              fully_shard_hybrid(make_model(c, at::kCPU), mesh, {}, bf16 ? Wire::kBFloat16 : Wire::kReduceDtype);
          auto data = make_dataset(c.model, c.seed);
          auto step = [&](int s) {
            auto micro = micro_batches(rank_slice(data->global_batch(s, c.global_batch), world.rank(), 4), k);
            for (int i = 0; i < k; ++i) {
              const bool last = i + 1 == k;
              if (deferred) set_requires_all_reduce(*fsdp, last);
              if (deferred || last) {
                (fsdp->loss(micro[i]) / k).backward();
              } else {
                auto scope = fsdp->no_sync();
                (fsdp->loss(micro[i]) / k).backward();
              }
            }
          };
          step(0);  // the sharded gradients exist from here on, as in every later step
          for (const auto& p : fsdp->parameters()) p.mutable_grad().zero_();
          fsdp->reset_memory_peaks();
          step(1);
          const fsdp::MemoryTheory t =
              fsdp->memory_theory(k, deferred ? fsdp::Accumulation::kReduce : fsdp::Accumulation::kNoSync);
          const int64_t measured = fsdp->memory().peak_grad_bytes;
          const int64_t root_grads = fsdp->units().back()->unsharded_grad_bytes();
          if (world.rank() == 0)
            std::cout << mode << ": gradient peak measured " << measured << " bytes, theory " << t.peak_grad_bytes
                      << " (slack allowed: the root's unsharded gradients, " << root_grads << ")\n";
          EXPECT_LE(measured, t.peak_grad_bytes) << mode << ": a buffer the theory does not count";
          EXPECT_LE(t.peak_grad_bytes - measured, root_grads) << mode << ": the theory counts more than is held";
          EXPECT_EQ(fsdp->memory().grad_bytes, t.sharded_grad_bytes)
              << mode << ": after the step only the sharded gradients are held";
        },
        test_group());
  }
}

}  // namespace
}  // namespace shardlab::hsdp
