// Stage 06 — HSDP on a 2-D mesh, ranks as threads over one store: every rank trains like one device on the union
// batch, the replicas of a shard stay bit-identical, the collectives per unit are one reduce-scatter in the row and
// one all-reduce across the column of the sizes theory gives, the gradient is divided once by N, one replica is
// stage 04 bit for bit, and the all-reduce is in flight (not waited for) when the next unit's reduce-scatter goes.
#include "shardlab/hsdp/hsdp.h"
#include "shardlab/hsdp/parallelize.h"
#include "shardlab/prefetch/prefetch.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/clipping.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <sstream>

namespace shardlab::hsdp {
namespace {

using fsdp::FullyShardedModel;
using test_support::on_cpu;
using test_support::test_group;

constexpr double kRtol = 1e-5, kAtol = 1e-6;

// Bytes every unit's HsdpReducer holds in its partial (deferred micro-batches).
int64_t partial_bytes(const FullyShardedModel& fsdp) {
  int64_t bytes = 0;
  for (const auto& unit : fsdp.units()) bytes += dynamic_cast<const HsdpReducer&>(unit->reducer()).partial_bytes();
  return bytes;
}

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
  TrainConfig c;
  c.model = "mlp";
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
  TrainConfig c;
  c.model = m.model;
  c.steps = 3;
  c.global_batch = 2 * N;
  c.micro_batches = 1;
  c.seed = 5;
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
  for (int r = 0; r < N; ++r) {
    const double diff = max_abs_diff(finals[r], ref.params);
    std::cout << m << " rank " << r << ": max |param - one device| = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << m << " rank " << r << " differs by " << diff;
  }
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
                         [](const auto& info) {
                           std::ostringstream s;
                           s << info.param;
                           return s.str();
                         });

// Clipping under HSDP: the shards' norms are joined over the shard group only (the replicas hold the same shards:
// joined over the world, each element would count R times and the 2-norm's scale be off by a factor sqrt(R); a
// maximum over copies is the same, so only the 2-norm can tell). A bound that binds trains like the clipped single
// device on a 2 x 2 mesh, in the 2-norm and the max norm. While the all-reduce is deferred, clipping is refused.
TEST(HsdpClipping, TheReplicasAreNotCountedTwiceAndTrainingMatchesTheClippedSingleDevice) {
  TrainConfig base;
  base.model = "mlp";
  base.steps = 3;
  base.global_batch = 8;
  base.seed = 5;
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
    for (int r = 0; r < 4; ++r) {
      const double diff = max_abs_diff(finals[r], ref.params);
      std::cout << "p " << p << " rank " << r << ": max |param - clipped reference| = " << diff << "\n";
      EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol)) << "rank " << r << " max diff " << diff;
    }
  }
}

// Per unit per step, from the record (op, not wire_op): one reduce-scatter of S x row in the shard group and one
// all-reduce of the row (Σ padded shard numel, padding included) in the replicate group; the all-gathers stay in
// the shard group; nothing else. The reduce-scatters come in the same unit order as the all-reduces.
TEST(HsdpStructure, OneReduceScatterInTheRowAndOneAllReduceAcrossTheColumnPerUnitPerStep) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.steps = 2;
  c.global_batch = 8;
  run_world(
      4,
      [&](World& world) {
        Mesh mesh(world, 2, 2);
        auto model = make_model(c, at::kCPU);
        auto fsdp = fully_shard_hybrid(model, mesh);
        const std::string row = mesh.shard_group().name(), column = mesh.replicate_group().name();
        std::map<int64_t, int> expected_rs, expected_ar;  // numel -> count per step
        for (const auto& unit : fsdp->units()) {
          int64_t padded = 0;
          for (const auto& fp : unit->params())
            if (fp.trainable) padded += fp.spec.padded_numel();
          ++expected_rs[2 * padded];
          ++expected_ar[padded];
        }
        const size_t start = world.recorder().size();
        test_support::train_steps(world.world(), c, fsdp->parameters(), at::kCPU, *fsdp);
        std::map<int64_t, int> rs, ar;
        std::vector<int64_t> rs_rows, ar_rows;  // in issue order: the unit order of each group
        int gathers = 0;
        std::vector<std::string> other;
        for (const auto& r : world.recorder().since(start)) {
          if (r.op == "reduce_scatter") {
            EXPECT_EQ(r.group, row) << "a reduce-scatter outside the row";
            EXPECT_EQ(r.group_size, 2);
            ++rs[r.numel];
            rs_rows.push_back(r.numel / 2);
          } else if (r.op == "all_reduce") {
            EXPECT_EQ(r.group, column) << "an all-reduce outside the column";
            EXPECT_EQ(r.group_size, 2);
            ++ar[r.numel];
            ar_rows.push_back(r.numel);
          } else if (r.op == "all_gather") {
            EXPECT_EQ(r.group, row) << "an all-gather outside the row";
            ++gathers;
          } else {
            other.push_back(r.op + " on " + r.group);
          }
        }
        for (auto& [numel, count] : expected_rs) count *= c.steps;
        for (auto& [numel, count] : expected_ar) count *= c.steps;
        EXPECT_EQ(rs, expected_rs) << "one reduce-scatter of S x row per unit per step";
        EXPECT_EQ(ar, expected_ar) << "one all-reduce of the row per unit per step";
        EXPECT_EQ(rs_rows, ar_rows) << "the all-reduces come in the reduce-scatters' unit order";
        EXPECT_GT(gathers, 0);
        EXPECT_TRUE(other.empty()) << "nothing else in a step; got " << other.front();
        if (world.rank() == 0)
          std::cout << "per step: " << fsdp->units().size() << " reduce-scatters in " << row << ", "
                    << fsdp->units().size() << " all-reduces in " << column << "\n";
      },
      test_group());
}

// The divide is by N, once: every rank sees the same batch and scales its loss by (rank + 1), so the mean gradient
// is (N + 1) / 2 times one rank's unscaled gradient: 2.5 at 2x2, 3.5 at 3x2 and 2x3. A reducer that divides by S
// only gives 5 (2x2), one that divides by N and again per group 1.25, one that never divides 10; the test names
// the factor it saw. (In f32 a division split per group is also a mean: it differs only in its rounding.)
class HsdpDivide : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(HsdpDivide, TheGradientIsTheMeanOverAllNRanks) {
  const auto [R, S] = GetParam();
  const int N = R * S;
  const double mean = (N + 1) / 2.0;
  TrainConfig c;
  c.model = "mlp";
  c.global_batch = 4;
  auto reference = make_model(c, at::kCPU);
  auto data = make_dataset(c.model, c.seed);
  const Batch batch = data->global_batch(0, c.global_batch);
  reference->loss(batch).backward();
  std::vector<at::Tensor> single;
  for (const auto& p : reference->parameters()) single.push_back(p.grad().detach().clone());
  run_world(
      N,
      [&](World& world) {
        Mesh mesh(world, R, S);
        auto model = make_model(c, at::kCPU);
        auto fsdp = fully_shard_hybrid(model, mesh);
        (fsdp->loss(batch) * static_cast<double>(world.rank() + 1)).backward();
        const int r = mesh.shard_index();
        size_t i = 0;
        for (const auto& unit : fsdp->units())
          for (const auto& fp : unit->params()) {
            const at::Tensor g = single[i++].narrow(0, fp.spec.first_row_of(r), fp.spec.rows_of(r));
            if (g.numel() == 0) continue;
            const at::Tensor got = fp.sharded.grad();
            const double factor = (got * g).sum().item<double>() / (g * g).sum().item<double>();
            EXPECT_NEAR(factor, mean, 1e-5) << fp.name << " rank " << world.rank() << ": the gradient is " << factor
                                            << " x one rank's; the mean over N = " << N << " is " << mean << " x";
            EXPECT_TRUE(at::allclose(got, g * mean, 1e-5, 1e-7)) << fp.name;
          }
      },
      test_group());
}

// Divided once, by N's factors, not once per group, bit for bit. On a 2x3 mesh every rank reduces its own rows of
// small integers, so every sum is exact whatever order the collectives add in, and the mean has one rounding:
// (T / pre) / post with T the sum over the 6 ranks and pre * post = 6. The reducers that divide per group round
// more than once: by S after the reduce-scatter and by R after the all-reduce (the variant Note [One divide over
// two groups] warns of), by S before the reduce-scatter, or stage 03's hook factors applied in each group. The
// test first checks that its rows tell each of them apart from the single division, then names how many elements
// differ.
TEST(HsdpDivide, OnceByTheFactorsOfNNotOncePerGroupBitForBit) {
  constexpr int R = 2, S = 3, kRow = 4096;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
  std::vector<at::Tensor> x;  // rank r's gradient row: integers in about [-256, 256], exact in every sum
  for (int r = 0; r < R * S; ++r)
    x.push_back(at::round(at::randn({kRow}, gen, at::TensorOptions().dtype(at::kFloat)) * 64));
  auto pre_of = [](int n) { return comm_hooks::gradient_predivide_factor(n); };
  const double pre = pre_of(R * S), post = (R * S) / pre;
  std::vector<at::Tensor> row_sum;  // per row of the mesh: the exact sum of its S ranks
  for (int i = 0; i < R; ++i) row_sum.push_back(x[i * S] + x[i * S + 1] + x[i * S + 2]);
  const at::Tensor total = row_sum[0] + row_sum[1];
  const at::Tensor once = (total / pre) / post;
  std::map<std::string, at::Tensor> per_group{
      {"by S after the reduce-scatter, by R after the all-reduce", (row_sum[0] / S + row_sum[1] / S) / R},
      {"by S before the reduce-scatter, by R after the all-reduce",
       ((x[0] / S + x[1] / S + x[2] / S) + (x[3] / S + x[4] / S + x[5] / S)) / R},
      {"stage 03's factors in each group", (((row_sum[0] / pre_of(S)) / (S / pre_of(S))) / pre_of(R) +
                                            ((row_sum[1] / pre_of(S)) / (S / pre_of(S))) / pre_of(R)) /
                                               (R / pre_of(R))}};
  for (const auto& [name, variant] : per_group)
    ASSERT_FALSE(at::equal(once, variant)) << "the rows do not tell one division from dividing " << name;
  run_world(
      R * S,
      [&](World& world) {
        Mesh mesh(world, R, S);
        HsdpReducer reducer(mesh.shard_group(), mesh.replicate_group());
        at::Tensor input = x[world.rank()].repeat({S}), output = at::empty({kRow});
        reducer(input, output).wait();
        const int64_t wrong = output.ne(once).sum().item<int64_t>();
        std::string like;
        for (const auto& [name, variant] : per_group)
          if (at::equal(output, variant))
            like += (like.empty() ? "; it is exactly dividing " : ", and dividing ") + name;
        EXPECT_EQ(wrong, 0) << "rank " << world.rank() << ": " << wrong << " of " << kRow
                            << " elements differ from one division by N's factors (pre " << pre << ", post " << post
                            << ")" << like;
      },
      test_group());
}

INSTANTIATE_TEST_SUITE_P(Stage06, HsdpDivide,
                         ::testing::Values(std::make_pair(2, 2), std::make_pair(3, 2), std::make_pair(2, 3)),
                         [](const auto& info) {
                           return std::to_string(info.param.first) + "x" + std::to_string(info.param.second);
                         });

// One shard per replica (S = 1) is data parallelism: HSDP on a 4x1 mesh (shard groups of one rank, every gradient
// all-reduced over the 4 replicas) against stage 02's bucketed DDP on the same 4 ranks, within rtol 1e-6 (the sums
// differ in order: one all-reduce per unit against one per bucket, and pre/post division against DDP's mean).
TEST(HsdpDdp, OneShardPerReplicaIsBucketedDdpWithinRtol1e6) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.steps = 3;
  c.global_batch = 8;
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
  for (int r = 0; r < 4; ++r) {
    const double diff = max_abs_diff(hybrid[r], ddp[r]);
    std::cout << "4x1 rank " << r << ": max |hsdp - bucketed ddp| = " << diff << "\n";
    EXPECT_TRUE(all_close(hybrid[r], ddp[r], 1e-6, 1e-7)) << "rank " << r << " differs by " << diff;
  }
}

// Stage 04's and 05's options work unchanged under HSDP: units kept after forward with stage 05's prefetch (depth 1
// each way) train like one device within rtol 1e-5; bf16 compute with an f32 reduction matches stage 04's FSDP over
// all 4 ranks with the same policy after a step (each rank computes the same bf16 gradients of the same values; only
// the f32 sums run in another order).
TEST(HsdpOptions, KeptUnitsPrefetchAndMixedPrecisionWorkUnchanged) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.steps = 3;
  c.global_batch = 8;
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
        fsdp::Options bf16;
        bf16.mixed_precision.param_dtype = at::kBFloat16;
        bf16.mixed_precision.reduce_dtype = at::kFloat;
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
  for (int r = 0; r < 4; ++r) {
    const double diff = max_abs_diff(kept[r], ref.params), mp = max_abs_diff(hybrid_bf16[r], fsdp_bf16[r]);
    std::cout << "rank " << r << ": kept + prefetch vs one device " << diff << "; bf16 hsdp vs bf16 fsdp " << mp
              << "\n";
    EXPECT_TRUE(all_close(kept[r], ref.params, kRtol, kAtol))
        << "rank " << r << " (kept, prefetch) differs by " << diff;
    EXPECT_TRUE(all_close(hybrid_bf16[r], fsdp_bf16[r], 1e-6, 1e-7)) << "rank " << r << " (bf16) differs by " << mp;
  }
}

// One replica (R = 1) is stage 04's FSDP: the same collectives (no all-reduce at all) and the same bits.
TEST(HsdpFsdp, OneReplicaIsStage04BitForBit) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.steps = 2;
  c.global_batch = 8;
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

// The all-reduce is pipelined: when the next unit's reduce-scatter is issued, the previous unit's all-reduce has
// been issued (it is in the record) and not yet waited for (its handle's last step has not run), and the previous
// reduce-scatter's input (S rows of the unit's gradients) is already freed, not held until the end of backward. A
// reducer that chains the all-reduce as a then() step, issued and waited for inside FSDP's wait, fails here, as does
// one that keeps its input to the last step.
class Watching final : public fsdp::GradientReducer {
 public:
  Watching(std::shared_ptr<fsdp::GradientReducer> inner, World& world, std::string column,
           std::vector<std::string>* seen, std::vector<bool>* waited,
           std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>* inputs)
      : inner_(std::move(inner)),
        world_(world),
        column_(std::move(column)),
        seen_(seen),
        waited_(waited),
        inputs_(inputs) {}
  Handle operator()(const at::Tensor& input, const at::Tensor& output) override {
    const size_t k = waited_->size();  // this call's index in the step
    int all_reduces = 0;
    for (const auto& r : world_.recorder().since(0))
      if (r.op == "all_reduce" && r.group == column_) ++all_reduces;
    bool earlier_waited = false;
    for (size_t j = 0; j < k; ++j) earlier_waited = earlier_waited || (*waited_)[j];
    size_t held = 0;  // earlier units' reduce-scatter inputs still alive
    for (const auto& weak : *inputs_) held += weak.expired() ? 0 : 1;
    seen_->push_back("call " + std::to_string(k) + ": " + std::to_string(all_reduces) + " all-reduces issued, " +
                     (earlier_waited ? "an earlier one waited for" : "none waited for") + ", " + std::to_string(held) +
                     " earlier inputs held");
    waited_->push_back(false);
    inputs_->push_back(input.storage().getWeakStorageImpl());
    return (*inner_)(input, output).then([waited = waited_, k] { (*waited)[k] = true; });
  }
  int64_t scratch_bytes(c10::ScalarType dtype, int64_t numel, c10::Device device) const override {
    return inner_->scratch_bytes(dtype, numel, device);
  }
  std::string name() const override { return "watching"; }

 private:
  std::shared_ptr<fsdp::GradientReducer> inner_;
  World& world_;
  std::string column_;
  std::vector<std::string>* seen_;
  std::vector<bool>* waited_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>* inputs_;  // every unit's, shared
};

TEST(HsdpPipeline, TheAllReduceIsInFlightNotWaitedForWhenTheNextReduceScatterIsIssued) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 8;
  run_world(
      4,
      [&](World& world) {
        Mesh mesh(world, 2, 2);
        std::vector<std::string> seen;
        std::vector<bool> waited;
        std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> inputs;
        fsdp::Options options;
        const fsdp::ReducerFactory hsdp = hsdp_reducers();
        const std::string column = mesh.replicate_group().name();
        options.reducer = [&](const fsdp::ReducerRequest& request) -> std::shared_ptr<fsdp::GradientReducer> {
          return std::make_shared<Watching>(hsdp(request), world, column, &seen, &waited, &inputs);
        };
        auto model = make_model(c, at::kCPU);
        FullyShardedModel fsdp(model, mesh_info(mesh), options);  // as fully_shard_hybrid does
        auto data = make_dataset(c.model, c.seed);
        fsdp.loss(rank_slice(data->global_batch(0, c.global_batch), world.rank(), world.size())).backward();
        std::vector<std::string> expected;
        for (size_t k = 0; k < fsdp.units().size(); ++k)
          expected.push_back("call " + std::to_string(k) + ": " + std::to_string(k) +
                             " all-reduces issued, none waited for, 0 earlier inputs held");
        EXPECT_EQ(seen, expected) << "at each reduce-scatter, every earlier unit's all-reduce issued, none waited for, "
                                     "and every earlier reduce-scatter's input freed (its phase is over)";
        for (size_t k = 0; k < waited.size(); ++k) EXPECT_TRUE(waited[k]) << "unit call " << k << " by the end";
        if (world.rank() == 0)
          for (const auto& s : seen) std::cout << s << "\n";
      },
      test_group());
}

// fp16 and bf16 on the wire cover both phases (the record's dtype is theirs in the row and across the column; Gloo
// 1.13 carries bf16 as f32, which the record's wire_dtype shows), the shards stay f32 and bit-identical across
// replicas, and training stays close to f32.
TEST(HsdpCompressed, Fp16AndBf16OnBothGroupsTrainCloseToF32) {
  TrainConfig c;
  c.model = "mlp";
  c.steps = 3;
  c.global_batch = 8;
  const ReferenceResult ref = train_reference(c);
  for (const std::string name : {"fp16", "bf16"}) {
    const c10::ScalarType dtype = name == "fp16" ? at::kHalf : at::kBFloat16;
    std::vector<std::vector<at::Tensor>> finals(4);
    run_world(
        4,
        [&](World& world) {
          Mesh mesh(world, 2, 2);
          auto model = make_model(c, at::kCPU);
          auto fsdp = fully_shard_hybrid(model, mesh, {}, parse_wire(name));
          const size_t start = world.recorder().size();
          test_support::train_steps(world.world(), c, fsdp->parameters(), at::kCPU, *fsdp);
          int reductions = 0;
          for (const auto& r : world.recorder().since(start)) {
            if (r.op != "reduce_scatter" && r.op != "all_reduce") continue;
            ++reductions;
            EXPECT_EQ(r.dtype, dtype) << name << " " << r.op << " on " << r.group << ": the wire dtype on both phases";
          }
          EXPECT_EQ(reductions, 2 * c.steps * static_cast<int>(fsdp->units().size()));
          for (const auto& p : fsdp->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
          finals[world.rank()] = on_cpu(fsdp->full_parameters());
        },
        test_group());
    const double diff = max_abs_diff(finals[0], ref.params);
    std::cout << "HSDP 2x2 " << name << " vs one device in f32: max |param diff| = " << diff << "\n";
    EXPECT_LT(diff, 2e-3) << name;
    EXPECT_GT(diff, 0) << name << ": a half-size reduction cannot be bit-identical to f32";
    for (int r = 1; r < 4; ++r) EXPECT_EQ(max_abs_diff(finals[r], finals[0]), 0) << name << " rank " << r;
  }
}

// ---- Task 3: accumulation that defers the all-reduce ------------------------------------------------------------

// k = 3 micro-batches per step, 2 steps, 2x2. Deferred (set_requires_all_reduce false on the first two): per unit
// per step 3 reduce-scatters and 1 all-reduce, the partial held between micro-batches and gone after the step, every
// rank within rtol 1e-5 of one device, shards bit-identical across replicas; the same deferred with fp16 on the wire
// (the partial kept in f32) within 2e-3. no_sync on the first two instead: one reduce-scatter and one all-reduce per
// unit per step, both on the last micro-batch.
TEST(HsdpAccumulation, DeferredAllReduceReduceScattersEveryMicroBatchAndAllReducesOnce) {
  TrainConfig c;
  c.model = "mlp";
  c.steps = 2;
  c.global_batch = 24;
  c.micro_batches = 3;
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
  TrainConfig c;
  c.model = "mlp";
  c.global_batch = 8;
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
TEST(HsdpAccumulation, DeferringOnAWrapperThatIsNotHsdpIsAnError) {
  TrainConfig c;
  c.model = "mlp";
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
  TrainConfig c;
  c.model = "tiny_gpt";
  c.global_batch = 16;
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

// ---- The library's entry point ---------------------------------------------------------------------------------

// parallelize() picks the wrapper from the mesh's shape (4x1: DDP, 1x4: FSDP, 2x2: HSDP) and each trains like one
// device on the union batch, with micro-batches under its no_sync; DDP refuses mixed precision and only HSDP defers
// its all-reduce, both with errors that name the mesh, before any collective of the wrong kind.
TEST(Parallelize, TheMeshShapeChoosesDdpFsdpOrHsdpAndEachTrainsLikeOneDevice) {
  TrainConfig c;
  c.model = "tiny_gpt";
  c.steps = 2;
  c.global_batch = 8;
  c.micro_batches = 2;
  const ReferenceResult ref = train_reference(c);
  struct Shape {
    int replicate, shard;
    const char* kind;
  };
  for (const Shape& shape : {Shape{4, 1, "ddp"}, Shape{1, 4, "fsdp"}, Shape{2, 2, "hsdp"}}) {
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
          EXPECT_EQ(dp->kind_name(), shape.kind) << mesh.to_string();
          EXPECT_EQ(dp->sharded() != nullptr, shape.shard > 1) << mesh.to_string();
          if (shape.replicate == 1 || shape.shard == 1) {
            try {
              dp->set_requires_all_reduce(false);
              ADD_FAILURE() << shape.kind << " accepted set_requires_all_reduce";
            } catch (const std::invalid_argument& e) {
              EXPECT_NE(std::string(e.what()).find("this is " + std::string(shape.kind) + " on a " + mesh.to_string()),
                        std::string::npos)
                  << e.what();
            }
          }
          test_support::train_steps(world.world(), c, dp->parameters(), at::kCPU, *dp);
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
    for (int r = 0; r < 4; ++r) {
      const double diff = max_abs_diff(finals[r], ref.params);
      std::cout << shape.kind << " rank " << r << ": max |param - one device| = " << diff << "\n";
      EXPECT_TRUE(all_close(finals[r], ref.params, kRtol, kAtol))
          << shape.kind << " rank " << r << " differs by " << diff;
    }
  }
}

}  // namespace
}  // namespace shardlab::hsdp
