// Stage 06 — HSDP's reduction on a 2-D mesh, ranks as threads over one store: per unit one reduce-scatter in the row
// and one all-reduce across the column of the sizes theory gives, the gradient divided once by N, the all-reduce in
// flight (not waited for) when the next unit's reduce-scatter goes, and fp16 and bf16 on both groups.
#include "shardlab/hsdp/hsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/compressed.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <string>

namespace shardlab::hsdp {
namespace {

using fsdp::FullyShardedModel;
using test_support::on_cpu;
using test_support::test_group;

// ---- Task 2: the reduction ---------------------------------------------------------------------------------------

// Per unit per step, from the record (op, not wire_op): one reduce-scatter of S x row in the shard group and one
// all-reduce of the row (Σ padded shard numel, padding included) in the replicate group; the all-gathers stay in
// the shard group; nothing else. The reduce-scatters come in the same unit order as the all-reduces.
TEST(HsdpStructure, OneReduceScatterInTheRowAndOneAllReduceAcrossTheColumnPerUnitPerStep) {
  TrainConfig c = test_support::config("tiny_gpt").steps(2).global_batch(8);
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
  TrainConfig c = test_support::config("mlp").global_batch(4);
  auto reference = make_model(c, at::kCPU);
  const Batch batch = make_dataset(c.model, c.seed)->global_batch(0, c.global_batch);
  reference->loss(batch).backward();
  const std::vector<at::Tensor> single = test_support::grad_copies(reference->parameters());
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
  TrainConfig c = test_support::config("tiny_gpt").global_batch(8);
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
  TrainConfig c = test_support::config("mlp").steps(3).global_batch(8);
  const ReferenceResult ref = train_reference(c);
  for (const auto& [name, dtype] : test_support::compressed_reductions()) {
    std::vector<std::vector<at::Tensor>> finals(4);
    run_world(
        4,
        [&, &name = name, &dtype = dtype](World& world) {
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
    test_support::expect_close_to_f32(finals[0], ref.params, name, "HSDP 2x2 " + name + " vs one device in f32");
    for (int r = 1; r < 4; ++r) EXPECT_EQ(max_abs_diff(finals[r], finals[0]), 0) << name << " rank " << r;
  }
}

}  // namespace
}  // namespace shardlab::hsdp
