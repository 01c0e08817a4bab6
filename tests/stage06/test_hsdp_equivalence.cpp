// Stage 06 — HSDP on a 2-D mesh trains like one device, ranks as threads over one store: every replica starts from
// global rank 0's values, every rank matches one device on the union batch (clipped too) with the replicas of a shard
// bit-identical, one shard per replica is bucketed DDP, one replica is stage 04 bit for bit, stage 04's and 05's
// options work unchanged, and parallelize() picks DDP, FSDP or HSDP from the mesh's shape.
#include "shardlab/hsdp/hsdp.h"
#include "shardlab/hsdp/parallelize.h"
#include "shardlab/prefetch/prefetch.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "stage06/hsdp_support.h"
#include "support/clipping.h"
#include "support/group.h"
#include "support/mixed_precision.h"
#include "support/param_name.h"
#include "support/tolerance.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>
#include <string>

namespace shardlab::hsdp {
namespace {

using fsdp::FullyShardedModel;
using namespace test_support;  // tests/support: the rank loops, builders and checks

// This rank's shards (its real rows of every parameter), in units() order.
std::vector<at::Tensor> shards(const FullyShardedModel& fsdp) {
  std::vector<at::Tensor> out;
  for (const auto& unit : fsdp.units())
    for (const auto& fp : unit->params()) out.push_back(fp.sharded.detach().clone());
  return out;
}

// ---- Task 1: construction --------------------------------------------------------------------------------------

// Every replica starts from global rank 0's values, not only every rank of a row: each rank perturbs its model by its
// rank before wrapping, and afterwards every rank's full parameters are rank 0's originals. A wrapper that broadcasts
// only within the shard group leaves replica 1 on rank 2's values. The wrapper's mesh is the whole mesh, its replica
// this rank's row. A reducer set by the caller is refused, and a model FSDP rejects keeps each rank's own values (no
// broadcast before FSDP's checks).
TEST(HsdpConstruction, EveryReplicaStartsFromGlobalRankZerosValues) {
  TrainConfig c = test_support::config("mlp");
  const std::vector<at::Tensor> originals = on_cpu(make_model(c, at::kCPU)->parameters());
  run_world(
      4,
      [&](World& world) {
        Mesh mesh(world, 2, 2);
        auto model = make_model(c, at::kCPU);
        {
          at::NoGradGuard no_grad;
          for (auto& p : model->parameters()) p.add_(static_cast<double>(world.rank()));
        }
        auto fsdp = fully_shard_hybrid(model, mesh);
        EXPECT_EQ(&fsdp->mesh_info().everyone(), &world.world()) << "rank " << world.rank() << ": the whole mesh";
        EXPECT_EQ(fsdp->mesh_info().replica(), mesh.replica_index()) << "rank " << world.rank();
        EXPECT_EQ(fsdp->mesh_info().shard, &mesh.shard_group()) << "rank " << world.rank() << ": sharded over the row";
        const std::vector<at::Tensor> full = on_cpu(fsdp->full_parameters());
        EXPECT_EQ(max_abs_diff(full, originals), 0)
            << "rank " << world.rank() << " (replica " << mesh.replica_index() << ") starts "
            << max_abs_diff(full, originals) << " away from global rank 0's values";
        fsdp::Options preset;
        preset.reducer = fsdp::hook_reducers("reduce_scatter");
        try {
          fully_shard_hybrid(make_model(c, at::kCPU), mesh, preset);
          ADD_FAILURE() << "a reducer set by the caller was accepted";
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("Options::reducer"), std::string::npos) << e.what();
        }
        // A model FSDP rejects (a unit of mixed dtypes) is left as it was on every rank: nothing was broadcast.
        auto rejected = make_model(c, at::kCPU);
        {
          at::NoGradGuard no_grad;
          for (auto& p : rejected->parameters()) p.add_(static_cast<double>(world.rank()));
          auto params = rejected->parameters();
          params.back().set_data(params.back().to(at::kDouble));
        }
        const std::vector<at::Tensor> before = on_cpu(rejected->parameters());
        EXPECT_THROW(fully_shard_hybrid(rejected, mesh), std::invalid_argument) << "a unit of mixed dtypes";
        EXPECT_EQ(max_abs_diff(on_cpu(rejected->parameters()), before), 0)
            << "rank " << world.rank() << ": a rejected model's values changed (a broadcast before FSDP's checks)";
      },
      test_group());
}

// ---- Task 2: the reduction ---------------------------------------------------------------------------------------

struct MeshCase {
  int replicate, shard;
  std::string model;
};

std::ostream& operator<<(std::ostream& os, const MeshCase& m) {
  return os << m.model << "_" << m.replicate << "x" << m.shard;
}

class HsdpEquivalence : public ::testing::TestWithParam<MeshCase> {};

// Every rank equals one device on the union batch; the R ranks of a column hold bit-identical shards after every
// step (a replica that drifts by one bit is caught at the step it drifts).
TEST_P(HsdpEquivalence, MatchesOneDeviceAndTheReplicasOfAShardAreBitIdenticalAfterEveryStep) {
  const MeshCase m = GetParam();
  const int N = m.replicate * m.shard;
  TrainConfig c = test_support::config(m.model).steps(3).global_batch(2 * N).micro_batches(1).seed(5);
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> finals(N);
  std::vector<std::vector<std::vector<at::Tensor>>> per_step(N);  // [rank][step] -> shards
  run_world(
      N,
      [&](World& world) {
        Mesh mesh(world, m.replicate, m.shard);
        auto model = make_model(c, at::kCPU);
        fsdp::Options options;
        options.allow_unused_parameters = m.model == "edge";  // `sometimes` has no gradient on odd steps
        auto fsdp = fully_shard_hybrid(model, mesh, options);
        test_support::train_steps(world.world(), c, fsdp->parameters(), at::kCPU, *fsdp,
                                  [&](int) { per_step[world.rank()].push_back(shards(*fsdp)); });
        finals[world.rank()] = on_cpu(fsdp->full_parameters());
      },
      test_group());
  test_support::expect_ranks_match(finals, ref.params, m);
  // Rank = row * S + column: the ranks of column k are k, S + k, 2S + k, ...
  for (int col = 0; col < m.shard; ++col)
    for (int row = 1; row < m.replicate; ++row)
      for (int step = 0; step < c.steps; ++step) {
        const auto& a = per_step[col][step];
        const auto& b = per_step[row * m.shard + col][step];
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i)
          EXPECT_TRUE(at::equal(a[i], b[i])) << m << ": shard " << i << " of column " << col << " differs between "
                                             << "replica 0 and replica " << row << " after step " << step << " by "
                                             << (a[i] - b[i]).abs().max().item<double>();
      }
}

INSTANTIATE_TEST_SUITE_P(Stage06, HsdpEquivalence,
                         ::testing::Values(MeshCase{2, 2, "tiny_gpt"}, MeshCase{2, 3, "mlp"}, MeshCase{3, 2, "mlp"},
                                           MeshCase{4, 1, "mlp"}, MeshCase{2, 2, "edge"}),
                         test_support::StreamedName());

// Clipping under HSDP: the shards' norms are joined over the shard group only (the replicas hold the same shards:
// joined over the world, each element would count R times and the 2-norm's scale be off by a factor sqrt(R); a
// maximum over copies is the same, so only the 2-norm can tell). A bound that binds trains like the clipped single
// device on a 2 x 2 mesh, in the 2-norm and the max norm. While the all-reduce is deferred, clipping is refused.
TEST(HsdpClipping, TheReplicasAreNotCountedTwiceAndTrainingMatchesTheClippedSingleDevice) {
  TrainConfig base = test_support::config("mlp").steps(3).global_batch(8).seed(5);
  for (const double p : {2.0, test_support::kInfNorm}) {
    const TrainConfig c = test_support::binding_clip(base, 0.01, p);
    const ReferenceResult ref = train_reference(c);
    std::vector<std::vector<at::Tensor>> finals(4);
    run_world(
        4,
        [&](World& world) {
          Mesh mesh(world, 2, 2);
          auto model = make_model(c, at::kCPU);
          auto fsdp = fully_shard_hybrid(model, mesh, fsdp::Options{});
          test_support::train_steps(world.world(), c, fsdp->parameters(), at::kCPU, *fsdp);
          finals[world.rank()] = on_cpu(fsdp->full_parameters());
          // With the all-reduce deferred each replica's shards hold its own partial sum: clipping is refused.
          set_requires_all_reduce(*fsdp, false);
          auto data = make_dataset(c.model, c.seed);
          fsdp->loss(rank_slice(data->global_batch(0, c.global_batch), world.rank(), 4)).backward();
          EXPECT_THROW(fsdp->clip_grad_norm(1.0, p), std::logic_error) << "rank " << world.rank();
          set_requires_all_reduce(*fsdp, true);
          fsdp->loss(rank_slice(data->global_batch(1, c.global_batch), world.rank(), 4)).backward();
          EXPECT_NO_THROW(fsdp->clip_grad_norm(1e9, p)) << "rank " << world.rank() << ": after the all-reduce";
        },
        test_group());
    test_support::expect_ranks_match(finals, ref.params, "p", p);
  }
}

// One shard per replica (S = 1) is data parallelism: HSDP on a 4x1 mesh (shard groups of one rank, every gradient
// all-reduced over the 4 replicas) against stage 02's bucketed DDP on the same 4 ranks, within rtol 1e-6 (the sums
// differ in order: one all-reduce per unit against one per bucket, and pre/post division against DDP's mean).
TEST(HsdpDdp, OneShardPerReplicaIsBucketedDdpWithinRtol1e6) {
  TrainConfig c = test_support::config("tiny_gpt").steps(3).global_batch(8);
  std::vector<std::vector<at::Tensor>> hybrid(4), ddp(4);
  run_world(
      4,
      [&](World& world) {
        Mesh mesh(world, 4, 1);
        auto model = make_model(c, at::kCPU);
        auto fsdp = fully_shard_hybrid(model, mesh);
        test_support::train_steps(world.world(), c, fsdp->parameters(), at::kCPU, *fsdp);
        hybrid[world.rank()] = on_cpu(fsdp->full_parameters());
        auto replica = make_model(c, at::kCPU);
        bucketed_ddp::BucketedDDP plain(replica, world.world());
        ddp[world.rank()] = test_support::train_replica(world.world(), c, *replica, plain);
      },
      test_group());
  test_support::expect_ranks_close(hybrid, ddp, 1e-6, 1e-7, "4x1 hsdp vs bucketed ddp,");
}

// Stage 04's and 05's options work unchanged under HSDP: units kept after forward with stage 05's prefetch (depth 1
// each way) train like one device within rtol 1e-5; bf16 compute with an f32 reduction matches stage 04's FSDP over
// all 4 ranks with the same policy after a step (each rank computes the same bf16 gradients of the same values; only
// the f32 sums run in another order).
TEST(HsdpOptions, KeptUnitsPrefetchAndMixedPrecisionWorkUnchanged) {
  TrainConfig c = test_support::config("tiny_gpt").steps(3).global_batch(8);
  const ReferenceResult ref = train_reference(c);
  std::vector<std::vector<at::Tensor>> kept(4), hybrid_bf16(4), fsdp_bf16(4);
  run_world(
      4,
      [&](World& world) {
        Mesh mesh(world, 2, 2);
        fsdp::Options raf_off;
        raf_off.reshard_after_forward = false;
        auto model = make_model(c, at::kCPU);
        auto wrapper = fully_shard_hybrid(model, mesh, raf_off);
        prefetch::enable_prefetch(*wrapper);
        test_support::train_steps(world.world(), c, wrapper->parameters(), at::kCPU, *wrapper);
        kept[world.rank()] = on_cpu(wrapper->full_parameters());

        TrainConfig one = c;
        one.steps = 1;
        const fsdp::Options bf16 = test_support::bf16_compute_f32_reduce();
        auto m1 = make_model(one, at::kCPU);
        auto hybrid = fully_shard_hybrid(m1, mesh, bf16);
        test_support::train_steps(world.world(), one, hybrid->parameters(), at::kCPU, *hybrid);
        hybrid_bf16[world.rank()] = on_cpu(hybrid->full_parameters());
        auto m2 = make_model(one, at::kCPU);
        FullyShardedModel flat(m2, world.world(), bf16);
        test_support::train_steps(world.world(), one, flat.parameters(), at::kCPU, flat);
        fsdp_bf16[world.rank()] = on_cpu(flat.full_parameters());
      },
      test_group());
  test_support::expect_ranks_match(kept, ref.params, "kept + prefetch,");
  test_support::expect_ranks_close(hybrid_bf16, fsdp_bf16, 1e-6, 1e-7, "bf16 hsdp vs bf16 fsdp,");
}

// One replica (R = 1) is stage 04's FSDP: the same collectives (no all-reduce at all) and the same bits.
TEST(HsdpFsdp, OneReplicaIsStage04BitForBit) {
  TrainConfig c = test_support::config("tiny_gpt").steps(2).global_batch(8);
  std::vector<at::Tensor> hybrid, plain;
  run_world(
      2,
      [&](World& world) {
        Mesh mesh(world, 1, 2);
        auto model = make_model(c, at::kCPU);
        auto fsdp = fully_shard_hybrid(model, mesh);
        const size_t start = world.recorder().size();
        test_support::train_steps(world.world(), c, fsdp->parameters(), at::kCPU, *fsdp);
        for (const auto& r : world.recorder().since(start))
          EXPECT_NE(r.op, "all_reduce") << "one replica: nothing to all-reduce across";
        auto h = on_cpu(fsdp->full_parameters());
        auto model2 = make_model(c, at::kCPU);
        FullyShardedModel stage04(model2, mesh.shard_group());
        test_support::train_steps(world.world(), c, stage04.parameters(), at::kCPU, stage04);
        auto p = on_cpu(stage04.full_parameters());
        if (world.rank() == 0) {
          hybrid = h;
          plain = p;
        }
      },
      test_group());
  const double diff = max_abs_diff(hybrid, plain);
  std::cout << "HSDP 1x2 vs stage 04 FSDP on 2 ranks: max |param diff| = " << diff << "\n";
  EXPECT_EQ(diff, 0) << "HSDP on one replica must be FSDP bit for bit";
}

// ---- The library's entry point ---------------------------------------------------------------------------------

// parallelize() picks the wrapper from the mesh's shape (4x1: DDP, 1x4: FSDP, 2x2: HSDP: told by its facets and by
// what it sends) and each trains like one device on the union batch, with micro-batches under its no_sync; DDP
// refuses mixed precision with an error that names the mesh, before any collective.
TEST(Parallelize, TheMeshShapeChoosesDdpFsdpOrHsdpAndEachTrainsLikeOneDevice) {
  TrainConfig c = test_support::config("tiny_gpt").steps(2).global_batch(8).micro_batches(2);
  const ReferenceResult ref = train_reference(c);
  for (const MeshShape& shape : {MeshShape{4, 1, "ddp"}, MeshShape{1, 4, "fsdp"}, MeshShape{2, 2, "hsdp"}}) {
    std::vector<std::vector<at::Tensor>> finals(4);
    run_world(
        4,
        [&](World& world) {
          Mesh mesh(world, shape.replicate, shape.shard);
          auto model = make_model(c, at::kCPU);
          if (shape.shard == 1) {
            ParallelPolicy mixed;
            mixed.mixed_precision.param_dtype = at::kBFloat16;
            try {
              parallelize(make_model(c, at::kCPU), mesh, mixed);
              ADD_FAILURE() << "DDP accepted mixed precision";
            } catch (const std::invalid_argument& e) {
              EXPECT_NE(std::string(e.what()).find("4x1 mesh (shard size 1) gives DDP"), std::string::npos) << e.what();
            }
          }
          auto dp = parallelize(model, mesh);
          const size_t trained = world.recorder().size();
          test_support::train_steps(world.world(), c, dp->parameters(), at::kCPU, *dp);
          EXPECT_EQ(kind_of(*dp, world.recorder().since(trained)), shape.kind) << mesh.to_string();
          finals[world.rank()] = on_cpu(dp->full_parameters());
          // The reduction policy's wire reaches the wrapper: fp16 buckets under DDP, fp16 on both groups otherwise.
          ParallelPolicy fp16;
          fp16.reduction.wire = Wire::kFloat16;
          auto compressed = parallelize(make_model(c, at::kCPU), mesh, fp16);
          const size_t mark = world.recorder().size();
          compressed->loss(rank_slice(make_dataset(c.model, c.seed)->global_batch(0, c.global_batch), world.rank(), 4))
              .backward();
          size_t reductions = 0;
          for (const auto& r : world.recorder().since(mark)) {
            if (r.op != "all_reduce" && r.op != "reduce_scatter") continue;
            ++reductions;
            EXPECT_EQ(r.dtype, at::kHalf) << shape.kind << ": a " << r.op << " of " << c10::toString(r.dtype);
          }
          EXPECT_GT(reductions, 0u) << shape.kind;
        },
        test_group());
    test_support::expect_ranks_match(finals, ref.params, shape.kind);
  }
}

}  // namespace
}  // namespace shardlab::hsdp
