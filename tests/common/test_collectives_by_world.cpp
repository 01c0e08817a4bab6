// The Communicator's collectives at every world size, on real Gloo process groups with ranks as threads (and one rank
// on NCCL where there is a GPU): results in every dtype, the fallbacks Gloo needs, and what the record says went on the
// wire.
#include "shardlab/core/comm/thread_ranks.h"
#include "support/device.h"
#include "support/group.h"
#include "support/param_name.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <iostream>
#include <sstream>
#include <string>

namespace shardlab {
namespace {

using test_support::test_group;

// One parametrization: `world` thread ranks on Gloo (tensors on the test device, see support/device.h), or one
// rank on NCCL (tensors on cuda:0; skipped without a GPU).
struct GroupCase {
  int world;
  BackendKind kind;
};

std::ostream& operator<<(std::ostream& os, const GroupCase& g) {
  // The name says why an NCCL case is skipped on a machine without one: ctest prints only "Skipped".
  return os << (g.kind == BackendKind::kNccl ? "nccl" : "gloo") << "_w" << g.world
            << (g.kind == BackendKind::kNccl ? "_needs_a_gpu" : "");
}

class CollectivesByWorld : public ::testing::TestWithParam<GroupCase> {
 protected:
  void SetUp() override {
    if (GetParam().kind == BackendKind::kNccl && !test_support::nccl_usable())
      GTEST_SKIP() << "needs a CUDA libtorch with NCCL and a GPU";
    device_ = GetParam().kind == BackendKind::kNccl ? c10::Device(c10::kCUDA, 0) : test_support::device();
    options_ = test_group();
    options_.kind = GetParam().kind;
  }
  // Rank r's input: r+1 everywhere (so sums and averages are known in closed form).
  at::Tensor rank_tensor(const Communicator& c, int64_t n, at::ScalarType dt) const {
    return at::full({n}, static_cast<double>(c.rank() + 1), at::TensorOptions().dtype(dt).device(device_));
  }
  at::TensorOptions on_device(at::ScalarType dt) const { return at::TensorOptions().dtype(dt).device(device_); }

  c10::Device device_{c10::kCPU};
  GroupOptions options_;
};

double sum_1_to(int w) { return w * (w + 1) / 2.0; }

// What Gloo does itself, stated here independently of compat::gloo_features() on purpose, so that a wrong version
// gate there fails here. Probed: 1.13 has neither bf16 nor the flat all-gather; 2.6 has both (CPU tensors).
constexpr bool kGlooBf16AndFlatAllGather = TORCH_VERSION_MAJOR > 2 ||
                                           (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6);

TEST_P(CollectivesByWorld, AllReduceSumAndAvgForEveryDtype) {
  const int world = GetParam().world;
  run_ranks(
      world,
      [&](Communicator& c) {
        for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
          at::Tensor s = rank_tensor(c, 10, dt), a = rank_tensor(c, 10, dt);
          auto hs = c.all_reduce(s, ReduceOp::kSum);
          auto ha = c.all_reduce(a, ReduceOp::kAvg);
          hs.wait();
          ha.wait();
          EXPECT_EQ(s.scalar_type(), dt);
          // Exact in every dtype for w <= 4: the sum w(w+1)/2 <= 10 and the average (w+1)/2 in halves.
          const at::Tensor want_sum = at::full({10}, sum_1_to(world), s.options());
          const at::Tensor want_avg = at::full({10}, sum_1_to(world) / world, a.options());
          const double sum_err = (s.to(at::kDouble) - sum_1_to(world)).abs().max().item<double>();
          const double avg_err = (a.to(at::kDouble) - sum_1_to(world) / world).abs().max().item<double>();
          if (c.rank() == 0)
            std::cout << GetParam() << " " << device_ << " " << c10::toString(dt) << ": max |sum err| " << sum_err
                      << ", max |avg err| " << avg_err << "\n";
          EXPECT_TRUE(at::equal(s, want_sum))
              << c10::toString(dt) << ": sum differs from " << sum_1_to(world) << " by up to " << sum_err;
          EXPECT_TRUE(at::equal(a, want_avg))
              << c10::toString(dt) << ": average differs from " << sum_1_to(world) / world << " by up to " << avg_err;
        }
        auto recs = c.recorder().snapshot();
        ASSERT_EQ(recs.size(), 8u);
        for (const auto& r : recs) {
          EXPECT_EQ(r.op, "all_reduce");
          EXPECT_EQ(r.numel, 10);
          EXPECT_EQ(r.group, "world");
          EXPECT_GT(r.end_ns, 0);
          EXPECT_GE(r.end_ns, r.start_ns);
          // On Gloo 1.13 bf16 goes on the wire as f32 (Note [Fallbacks]): twice the bytes, and the record says so.
          const bool native = c.kind() == BackendKind::kNccl || r.dtype != at::kBFloat16 || kGlooBf16AndFlatAllGather;
          EXPECT_EQ(c.reduces_natively(r.dtype), native) << c10::toString(r.dtype);
          EXPECT_EQ(r.bytes, native ? 10 * static_cast<int64_t>(c10::elementSize(r.dtype)) : 40)
              << c10::toString(r.dtype);
          EXPECT_EQ(r.wire_dtype, native ? r.dtype : at::kFloat);
        }
      },
      options_);
}

TEST_P(CollectivesByWorld, BroadcastAllGatherReduceScatter) {
  const int world = GetParam().world;
  run_ranks(
      world,
      [&](Communicator& c) {
        for (auto dt : {at::kFloat, at::kBFloat16}) {
          // broadcast from the last rank
          at::Tensor b = rank_tensor(c, 5, dt);
          c.broadcast(b, world - 1).wait();
          EXPECT_TRUE(at::equal(b, at::full({5}, static_cast<double>(world), b.options())));

          // all_gather: rank r contributes [r*10, r*10+1, r*10+2] into one flat output
          at::Tensor in = at::arange(3, on_device(dt)) + 10.0 * c.rank();
          at::Tensor out = at::empty({3 * world}, in.options());
          c.all_gather(out, in).wait();
          for (int r = 0; r < world; ++r)
            EXPECT_TRUE(at::equal(out.narrow(0, 3 * r, 3), at::arange(3, in.options()) + 10.0 * r)) << "chunk " << r;
          // any shapes with the right element counts: a [2, 3] input into a [world, 2, 3] output
          at::Tensor in2 = (at::arange(6, on_device(dt)) + 10.0 * c.rank()).view({2, 3});
          at::Tensor out2 = at::empty({world, 2, 3}, in2.options());
          c.all_gather(out2, in2).wait();
          for (int r = 0; r < world; ++r)
            EXPECT_TRUE(at::equal(out2[r], (at::arange(6, in2.options()) + 10.0 * r).view({2, 3})))
                << "2-D chunk " << r;

          // reduce_scatter: every rank sends the same [0, 1, ..., 2w-1] * (rank+1); rank r keeps chunk r of the sum
          at::Tensor full = at::arange(2 * world, on_device(dt)) * static_cast<double>(c.rank() + 1);
          at::Tensor keep = full.clone();
          at::Tensor mine = at::empty({2}, full.options()), mine_avg = at::empty({2}, full.options());
          c.reduce_scatter(mine, full, ReduceOp::kSum).wait();
          c.reduce_scatter(mine_avg, full, ReduceOp::kAvg).wait();
          at::Tensor mine_2d = at::empty({1, 2}, full.options());
          c.reduce_scatter(mine_2d, full.view({world, 2}), ReduceOp::kSum).wait();  // shapes need not be flat
          // Integers times sum(1..w) <= 10, and their averages in halves: exact in every dtype, whatever the order.
          at::Tensor expect = at::arange(2 * c.rank(), 2 * c.rank() + 2, on_device(at::kDouble)) * sum_1_to(world);
          auto values = [](const at::Tensor& t) {
            const at::Tensor d = t.to(at::kDouble).cpu();
            return std::to_string(d[0].item<double>()) + ", " + std::to_string(d[1].item<double>());
          };
          EXPECT_TRUE(at::equal(mine, expect.to(dt)))
              << c10::toString(dt) << ": sum chunk [" << values(mine) << "], expected [" << values(expect) << "]";
          EXPECT_TRUE(at::equal(mine_2d.view({-1}), mine)) << "the 2-D reduce_scatter gives the same chunk";
          EXPECT_TRUE(at::equal(mine_avg, (expect / world).to(dt)))
              << c10::toString(dt) << ": average chunk [" << values(mine_avg) << "], expected ["
              << values(expect / world) << "]";
          EXPECT_TRUE(at::equal(full, keep)) << "reduce_scatter must not modify its input";
        }
        // What really went on the wire. NCCL: everything natively. Gloo: reduce_scatter as a ring of send/recv (CPU
        // tensors: N-1 of the N chunks sent) or an all-reduce of the whole input (CUDA tensors); 1.13 also a list
        // all-gather and bf16 as f32, 2.6 the flat all-gather (CPU tensors) and bf16 itself.
        const bool nccl = c.kind() == BackendKind::kNccl;
        const bool ring = !nccl && device_.is_cpu() && world <= 3;  // kAuto: these inputs are far below 1 MiB
        const at::Tensor like = at::empty({0}, on_device(at::kFloat));
        EXPECT_EQ(c.has_reduce_scatter(), nccl);
        EXPECT_EQ(c.has_flat_all_gather(like), nccl || (kGlooBf16AndFlatAllGather && device_.is_cpu()));
        EXPECT_EQ(c.all_gather_uses_ring(like), !nccl && device_.is_cpu()) << "kAuto: the ring for CPU tensors on Gloo";
        int seen = 0;
        for (const auto& r : c.recorder().snapshot()) {
          const bool native = nccl || r.dtype != at::kBFloat16 || kGlooBf16AndFlatAllGather;
          const int64_t wire_size = native ? static_cast<int64_t>(c10::elementSize(r.dtype)) : 4;
          EXPECT_EQ(r.wire_dtype, native ? r.dtype : at::kFloat) << r.op;
          if (r.op == "reduce_scatter") {
            EXPECT_EQ(r.wire_op, nccl ? "reduce_scatter" : ring ? "reduce_scatter(ring)" : "all_reduce");
            EXPECT_EQ(r.numel, 2 * world);
            EXPECT_EQ(r.bytes, (ring ? 2 * (world - 1) : 2 * world) * wire_size);
            ++seen;
          }
          if (r.op == "all_gather") {
            EXPECT_EQ(r.wire_op, c.all_gather_uses_ring(like)  ? "all_gather(ring)"
                                 : c.has_flat_all_gather(like) ? "all_gather"
                                                               : "all_gather(list)");
            EXPECT_TRUE(r.numel == 3 || r.numel == 6) << r.numel;
            EXPECT_EQ(r.bytes, r.numel * wire_size);
            ++seen;
          }
        }
        EXPECT_EQ(seen, 10) << "2 dtypes x (2 all_gathers + 3 reduce_scatters)";
        if (c.rank() == 0)
          std::cout << GetParam() << ": reduce_scatter "
                    << (c.has_reduce_scatter() ? "native"
                        : ring                 ? "ring"
                                               : "as all_reduce")
                    << ", all_gather "
                    << (c.all_gather_uses_ring(like)  ? "ring"
                        : c.has_flat_all_gather(like) ? "flat"
                                                      : "list")
                    << ", bf16 " << (c.reduces_natively(at::kBFloat16) ? "native" : "as f32") << "\n";
      },
      options_);
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesByWorld,
                         ::testing::Values(GroupCase{1, BackendKind::kGloo}, GroupCase{2, BackendKind::kGloo},
                                           GroupCase{3, BackendKind::kGloo}, GroupCase{4, BackendKind::kGloo},
                                           GroupCase{1, BackendKind::kNccl}),
                         test_support::StreamedName());

}  // namespace
}  // namespace shardlab
