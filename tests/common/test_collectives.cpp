// Tests of the Communicator on real Gloo process groups, ranks as threads: results, fallbacks, the collective
// record, asynchrony, the barrier, argument validation and timeouts; Handle's rules; comm_time.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/comm/world.h"
#include "support/delayed_backend.h"
#include "support/device.h"
#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <atomic>
#include <future>
#include <iostream>
#include <mutex>
#include <sstream>

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
                         [](const auto& info) {
                           std::ostringstream s;
                           s << info.param;
                           return s.str();
                         });

// The ring reduce-scatter (Note [Ring reduce-scatter]) against the all-reduce fallback, at world sizes 2-5 and
// chunk sizes that are odd, tiny and large. Integer-valued floats (and int64) make every sum exact whatever its
// order, so the two must agree bit for bit; with random floats they may differ in the last bit at 3 or more ranks
// (another summation order), but at 2 ranks a + b is one addition either way: bit for bit too.
TEST(Collectives, RingReduceScatterEqualsTheAllReduceFallbackAndSendsNMinus1OverNOfTheInput) {
  for (int world = 2; world <= 5; ++world) {
    run_ranks(
        world,
        [&](Communicator& c) {
          for (int64_t chunk : {1, 7, 1001}) {
            for (auto dt : {at::kFloat, at::kLong, at::kDouble}) {
              at::Tensor input = at::randint(-1000, 1000, {world * chunk}, at::TensorOptions().dtype(dt)) *
                                 static_cast<int64_t>(c.rank() + 1);
              at::Tensor ring_out = at::empty({chunk}, input.options()), ar_out = at::empty({chunk}, input.options());
              const size_t mark = c.recorder().size();
              c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
              c.reduce_scatter(ring_out, input, ReduceOp::kSum).wait();
              c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kAllReduce);
              c.reduce_scatter(ar_out, input, ReduceOp::kSum).wait();
              EXPECT_TRUE(at::equal(ring_out, ar_out)) << "world " << world << " chunk " << chunk << " " << dt;
              const auto recs = c.recorder().since(mark);
              ASSERT_EQ(recs.size(), 2u);
              const int64_t elem = static_cast<int64_t>(c10::elementSize(dt));
              EXPECT_EQ(recs[0].wire_op, "reduce_scatter(ring)");
              EXPECT_EQ(recs[0].bytes, (world - 1) * chunk * elem) << "(N-1)/N of the input";
              EXPECT_EQ(recs[1].wire_op, "all_reduce");
              EXPECT_EQ(recs[1].bytes, world * chunk * elem) << "the whole input";
            }
            if (world == 2) {  // random floats: one addition per element either way
              at::Tensor input = at::randn({world * chunk});
              at::Tensor ring_out = at::empty({chunk}), ar_out = at::empty({chunk});
              c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
              c.reduce_scatter(ring_out, input, ReduceOp::kAvg).wait();
              c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kAllReduce);
              c.reduce_scatter(ar_out, input, ReduceOp::kAvg).wait();
              EXPECT_TRUE(at::equal(ring_out, ar_out)) << "random floats, chunk " << chunk;
            }
          }
          if (c.rank() == 0) std::cout << "world " << world << ": ring == all-reduce fallback\n";
        },
        test_group());
  }
}

// Several rings in flight at once (FSDP launches one per unit during backward) complete in order and each gets its
// own result: the tags keep their messages apart.
TEST(Collectives, RingReduceScattersInFlightTogetherKeepTheirMessagesApart) {
  run_ranks(
      3,
      [&](Communicator& c) {
        c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
        std::vector<at::Tensor> outs;
        std::vector<Handle> handles;
        for (int i = 0; i < 6; ++i) {
          at::Tensor input = at::full({3 * (i + 1)}, static_cast<double>(100 * i + c.rank()));
          outs.push_back(at::empty({i + 1}));
          handles.push_back(c.reduce_scatter(outs.back(), input, ReduceOp::kSum));
        }
        for (auto& h : handles) h.wait();
        for (int i = 0; i < 6; ++i)
          EXPECT_TRUE(outs[i].eq(300.0 * i + 3).all().item<bool>()) << "reduce-scatter " << i << ": " << outs[i];
      },
      test_group());
}

// The ring all-gather (Note [Ring all-gather]) against the backend's own, at world sizes 1-5, odd, tiny and large
// inputs, and every dtype Gloo carries (bf16 as f32 on 1.13): nothing is summed, so bit for bit. The record says
// which ran, with the input's bytes (the convention of every all-gather record).
TEST(Collectives, RingAllGatherEqualsTheBackendsAllGatherBitForBit) {
  for (int world = 1; world <= 5; ++world) {
    run_ranks(
        world,
        [&](Communicator& c) {
          for (int64_t n : {1, 7, 1001}) {
            for (auto dt : {at::kFloat, at::kDouble, at::kLong, at::kBFloat16, at::kHalf}) {
              at::Tensor input = (at::randn({n}) * 100 + c.rank()).to(dt);
              at::Tensor ring_out = at::full({world * n}, -1, input.options());
              at::Tensor own_out = at::full({world * n}, -2, input.options());
              const size_t mark = c.recorder().size();
              c.set_all_gather_algorithm(AllGatherAlgorithm::kRing);
              c.all_gather(ring_out, input).wait();
              c.set_all_gather_algorithm(AllGatherAlgorithm::kBackend);
              c.all_gather(own_out, input).wait();
              EXPECT_TRUE(at::equal(ring_out, own_out)) << "world " << world << " n " << n << " " << dt;
              EXPECT_TRUE(at::equal(ring_out.view({world, n})[c.rank()], input)) << "row rank() is the input";
              const auto recs = c.recorder().since(mark);
              ASSERT_EQ(recs.size(), 2u);
              EXPECT_EQ(recs[0].wire_op, "all_gather(ring)");
              EXPECT_EQ(recs[0].bytes, recs[1].bytes) << "the input's bytes on the wire dtype, either way";
              EXPECT_NE(recs[1].wire_op, "all_gather(ring)");
            }
          }
          if (c.rank() == 0) std::cout << "world " << world << ": ring all-gather == the backend's\n";
        },
        test_group());
  }
}

// What FSDP does during backward: ring all-gathers (the next units' prefetches) in flight beside ring
// reduce-scatters, several of each. Each gets its own result: their tags are apart. And neither waits for the
// other's worker: rank 0 issues every all-gather before any reduce-scatter, the others the reverse, which one
// worker for both kinds could not complete (it would run rank 0's first all-gather against the others' first
// reduce-scatter, and time out).
TEST(Collectives, RingAllGathersAndReduceScattersInFlightTogetherKeepTheirMessagesApart) {
  GroupOptions o = test_group();
  o.timeout = std::chrono::milliseconds(10'000);
  run_ranks(
      3,
      [&](Communicator& c) {
        c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
        c.set_all_gather_algorithm(AllGatherAlgorithm::kRing);
        std::vector<at::Tensor> gathered(6), reduced(6);
        std::vector<Handle> handles;
        auto gather = [&](int i) {
          gathered[i] = at::empty({3 * (i + 1)});
          handles.push_back(c.all_gather(gathered[i], at::full({i + 1}, static_cast<double>(10 * i + c.rank()))));
        };
        auto reduce = [&](int i) {
          reduced[i] = at::empty({i + 1});
          handles.push_back(c.reduce_scatter(reduced[i], at::full({3 * (i + 1)}, static_cast<double>(c.rank()))));
        };
        for (int kind = 0; kind < 2; ++kind)
          for (int i = 0; i < 6; ++i) {
            if ((kind == 0) == (c.rank() == 0)) {
              gather(i);
            } else {
              reduce(i);
            }
          }
        for (auto& h : handles) h.wait();
        for (int i = 0; i < 6; ++i) {
          at::Tensor expect = at::arange(3, at::kFloat).add(10.0 * i).repeat_interleave(i + 1);
          EXPECT_TRUE(at::equal(gathered[i], expect)) << "all-gather " << i << ": " << gathered[i];
          EXPECT_TRUE(reduced[i].eq(3.0).all().item<bool>()) << "reduce-scatter " << i << ": " << reduced[i];
        }
      },
      o);
}

TEST(Collectives, AutoChoosesTheRingWhereItWasMeasuredFaster) {
  EXPECT_TRUE(ring_reduce_scatter_pays(2, 4));
  EXPECT_TRUE(ring_reduce_scatter_pays(2, 64 << 20));
  EXPECT_TRUE(ring_reduce_scatter_pays(3, 16 << 10));
  EXPECT_FALSE(ring_reduce_scatter_pays(4, 64 << 10));
  EXPECT_TRUE(ring_reduce_scatter_pays(4, 1 << 20));
  run_ranks(
      4,
      [&](Communicator& c) {
        EXPECT_EQ(c.reduce_scatter_algorithm(), ReduceScatterAlgorithm::kAuto);
        at::Tensor small = at::ones({4 * 4}), large = at::ones({4 * (1 << 18)});
        at::Tensor out_small = at::empty({4}), out_large = at::empty({1 << 18});
        const size_t mark = c.recorder().size();
        c.reduce_scatter(out_small, small).wait();
        c.reduce_scatter(out_large, large).wait();
        const auto recs = c.recorder().since(mark);
        EXPECT_EQ(recs[0].wire_op, "all_reduce") << "64 bytes at 4 ranks";
        EXPECT_EQ(recs[1].wire_op, "reduce_scatter(ring)") << "4 MiB at 4 ranks";
        EXPECT_TRUE(out_large.eq(4).all().item<bool>());
      },
      test_group());
}

// all_reduce gives control back while the collective cannot have completed: rank 1 joins it only after rank 0 has
// returned from issuing it and said so. A blocking all_reduce never returns on rank 0 (its peer is not there yet),
// and fails by the group's timeout instead. wait() then makes the result visible.
TEST(Collectives, AsyncWorkOverlapsTheCallingThread) {
  std::promise<void> issued;
  std::shared_future<void> rank0_returned = issued.get_future().share();
  run_ranks(
      2,
      [&](Communicator& c) {
        at::Tensor t = at::ones({1 << 16});
        if (c.rank() == 1) {
          rank0_returned.wait();
          c.all_reduce(t).wait();
          EXPECT_EQ(t[0].item<float>(), 2.0f);
          return;
        }
        struct Release {  // however rank 0 leaves (a blocking all_reduce throws its timeout), rank 1 is released
          std::promise<void>& p;
          bool released = false;
          void now() {
            if (!released) p.set_value();
            released = true;
          }
          ~Release() { now(); }
        } release{issued};
        Handle h = c.all_reduce(t);
        EXPECT_FALSE(h.done());
        EXPECT_EQ(c.recorder().snapshot().back().end_ns, 0) << "complete although rank 1 has not joined yet";
        release.now();
        h.wait();
        EXPECT_TRUE(h.done());
        EXPECT_EQ(t[0].item<float>(), 2.0f);
        EXPECT_GT(c.recorder().snapshot().back().end_ns, 0) << "wait() returns with the record closed";
        h.wait();  // a second wait is a no-op
      },
      test_group());
}

// barrier() returns on no rank before every rank has called it. Rank 1 holds back before calling it, until rank 0
// has returned from its own barrier (which a barrier that does not block lets it do at once) or for a second at
// most; rank 0 then checks that rank 1 had arrived. A correct barrier passes however long rank 1 holds back: the
// hold-back only gives a barrier that does not wait the time to show it.
TEST(Collectives, BarrierReturnsOnlyOnceEveryRankHasCalledIt) {
  std::promise<void> returned;
  std::shared_future<void> rank0_returned = returned.get_future().share();
  std::atomic<bool> rank1_arrived{false};
  bool arrived_when_rank0_returned = false, rank0_returned_first = false;
  run_ranks(
      2,
      [&](Communicator& c) {
        if (c.rank() == 1) {
          rank0_returned_first = rank0_returned.wait_for(std::chrono::seconds(1)) == std::future_status::ready;
          rank1_arrived = true;
          c.barrier();
        } else {
          struct Release {
            std::promise<void>& p;
            ~Release() { p.set_value(); }
          } release{returned};
          c.barrier();
          arrived_when_rank0_returned = rank1_arrived;
        }
        const auto recs = c.recorder().snapshot();
        ASSERT_EQ(recs.size(), 1u);
        EXPECT_EQ(recs[0].op, "barrier");
        EXPECT_GT(recs[0].end_ns, 0) << "barrier() returns with its record closed";
      },
      test_group());
  EXPECT_FALSE(rank0_returned_first) << "rank 0's barrier returned while rank 1 held back from calling barrier()";
  EXPECT_TRUE(arrived_when_rank0_returned) << "rank 0's barrier returned before rank 1 had called barrier()";
}

TEST(Collectives, BadArgumentsThrowAtTheCallNamingWhatWasExpected) {
  run_ranks(
      1,
      [](Communicator& c) {
        auto expect_message = [](auto&& fn, const std::string& needle) {
          try {
            fn();
            ADD_FAILURE() << "expected std::invalid_argument containing '" << needle << "'";
          } catch (const std::invalid_argument& e) {
            std::cout << "rejected: " << e.what() << "\n";
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
          }
        };
        at::Tensor m = at::ones({4, 4});
        expect_message([&] { c.all_reduce(m.t().narrow(0, 0, 2)); }, "contiguous");
        expect_message([&] { c.all_reduce(at::ones({3}, at::kBool)); }, "dtype");
        expect_message([&] { c.all_reduce(at::ones({3}, at::kLong), ReduceOp::kAvg); }, "floating");
        expect_message([&] { c.broadcast(at::ones({3}), 1); }, "root");
        expect_message([&] { c.all_gather(at::ones({5}), at::ones({3})); }, "elements");
        expect_message([&] { c.all_gather(at::ones({3}, at::kDouble), at::ones({3})); }, "dtype");
        expect_message([&] { c.reduce_scatter(at::ones({2}), at::ones({3})); }, "elements");
        expect_message([&] { c.all_reduce(at::Tensor()); }, "undefined");
        EXPECT_EQ(c.recorder().size(), 0u) << "nothing may be submitted for a rejected call";
      },
      test_group());
}

// Also the rings (all-gather, reduce-scatter), whose steps run on a worker of the Communicator's own.
TEST(Collectives, AMissingRankTimesOutWithTheOpAndRankInTheMessage) {
  for (const std::string op : {"all_reduce", "all_gather", "reduce_scatter"}) {
    GroupOptions o;
    o.timeout = std::chrono::milliseconds(1500);
    std::string message;
    std::promise<void> rank0_done;
    std::shared_future<void> done = rank0_done.get_future().share();
    run_ranks(
        2,
        [&](Communicator& c) {
          if (c.rank() == 1) {
            // Rank 1 never joins, but keeps its group alive until rank 0 has given up: a group destroyed early
            // would close the connection, and rank 0 would see that instead of a timeout.
            done.wait();
            return;
          }
          struct Release {  // however rank 0 leaves, rank 1 is released
            std::promise<void>& p;
            ~Release() { p.set_value(); }
          } release{rank0_done};
          c.set_all_gather_algorithm(AllGatherAlgorithm::kRing);
          c.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
          at::Tensor t = at::ones({8}), half = at::ones({4});
          try {
            if (op == "all_reduce") c.all_reduce(t).wait();
            if (op == "all_gather") c.all_gather(t, half).wait();
            if (op == "reduce_scatter") c.reduce_scatter(half, t).wait();
            ADD_FAILURE() << op << ": expected a timeout";
          } catch (const std::runtime_error& e) {
            message = e.what();
          }
        },
        o);
    std::cout << op << " timeout message: " << message << "\n";
    EXPECT_NE(message.find(op), std::string::npos) << message;
    EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
    EXPECT_NE(message.find("timed out (limit 1500 ms)"), std::string::npos) << "a timeout must say it was one";
  }
}

// A caller's mistake that only the other ranks can see: rank 1 passes twice the elements rank 0 does. Unchecked,
// Gloo ends the process on its transport thread (as PyTorch's does); with the check on (Note [Checked
// collectives]) it is an exception on every rank's own thread, at the call, naming both calls, for every kind of
// collective and algorithm, and the group goes on working.
TEST(Collectives, WithTheCheckOnASizeMismatchIsAnExceptionOnEveryRankAndTheGroupGoesOn) {
  struct Case {
    std::string op;
    AllGatherAlgorithm ag = AllGatherAlgorithm::kAuto;
    ReduceScatterAlgorithm rs = ReduceScatterAlgorithm::kAuto;
  };
  for (const Case& k : std::vector<Case>{
           {"all_reduce"},
           {"broadcast"},
           {"all_gather ring", AllGatherAlgorithm::kRing},
           {"all_gather backend", AllGatherAlgorithm::kBackend},
           {"reduce_scatter ring", AllGatherAlgorithm::kAuto, ReduceScatterAlgorithm::kRing},
           {"reduce_scatter all_reduce", AllGatherAlgorithm::kAuto, ReduceScatterAlgorithm::kAllReduce}}) {
    GroupOptions o = test_group();
    o.check_collectives = true;
    std::vector<std::string> messages(2);
    std::vector<size_t> recorded(2);
    std::vector<float> after(2);
    run_ranks(
        2,
        [&](Communicator& c) {
          ASSERT_TRUE(c.checks_collectives());
          c.set_all_gather_algorithm(k.ag);
          c.set_reduce_scatter_algorithm(k.rs);
          const int64_t n = c.rank() == 0 ? 4 : 8;
          at::Tensor t = at::ones({n}), whole = at::ones({2 * n});
          try {
            if (k.op == "all_reduce") c.all_reduce(t).wait();
            if (k.op == "broadcast") c.broadcast(t, 0).wait();
            if (k.op.rfind("all_gather", 0) == 0) c.all_gather(whole, t).wait();
            if (k.op.rfind("reduce_scatter", 0) == 0) c.reduce_scatter(t, whole).wait();
            messages[c.rank()] = "(no error)";
          } catch (const std::invalid_argument& e) {
            messages[c.rank()] = e.what();
          }
          recorded[c.rank()] = c.recorder().size();
          // The group still works: the next (matching) collective is paired with its like.
          at::Tensor x = at::full({3}, static_cast<float>(c.rank() + 1));
          c.all_reduce(x).wait();
          after[c.rank()] = x[0].item<float>();
        },
        o);
    const std::string op = k.op.substr(0, k.op.find(' '));
    const int in0 = op == "reduce_scatter" ? 8 : 4;  // the input's elements: a reduce-scatter's is the whole
    for (int r = 0; r < 2; ++r) {
      std::cout << k.op << ", rank " << r << ": " << messages[r] << "\n";
      const std::string want0 = "rank 0 calls " + op + " of " + std::to_string(in0) + " Float elements";
      const std::string want1 = "rank 1 calls " + op + " of " + std::to_string(2 * in0) + " Float elements";
      EXPECT_NE(messages[r].find(want0), std::string::npos) << messages[r];
      EXPECT_NE(messages[r].find(want1), std::string::npos) << messages[r];
      EXPECT_EQ(messages[r], messages[0]) << "every rank throws the same error";
      EXPECT_EQ(recorded[r], 0u) << k.op << ": nothing of the refused call may be sent";
      EXPECT_EQ(after[r], 3.0f) << k.op << ": the next all-reduce must pair with its like";
    }
  }
  // The same sizes by different paths (the ring on rank 0, Gloo's own all-gather on rank 1) would pair a send with
  // a collective: reported as well.
  GroupOptions o = test_group();
  o.check_collectives = true;
  std::vector<std::string> paths(2);
  run_ranks(
      2,
      [&](Communicator& c) {
        c.set_all_gather_algorithm(c.rank() == 0 ? AllGatherAlgorithm::kRing : AllGatherAlgorithm::kBackend);
        try {
          c.all_gather(at::ones({8}), at::ones({4})).wait();
        } catch (const std::invalid_argument& e) {
          paths[c.rank()] = e.what();
        }
      },
      o);
  for (int r = 0; r < 2; ++r) {
    std::cout << "algorithms, rank " << r << ": " << paths[r] << "\n";
    EXPECT_NE(paths[r].find("by the ring, rank 1 calls all_gather of 4 Float elements (output 8) on cpu, output "
                            "Float on cpu, by the backend"),
              std::string::npos)
        << "rank " << r << ": '" << paths[r] << "'";
  }
}

TEST(Collectives, RunRanksNamesTheFailingRank) {
  try {
    run_ranks(
        3,
        [](Communicator& c) {
          if (c.rank() == 2) throw std::runtime_error("boom");
        },
        test_group());
    FAIL() << "expected an exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 2: boom");
  }
}

}  // namespace
}  // namespace shardlab

namespace shardlab {
namespace {

// Handle: finish steps run exactly once, even when one throws, and a failure is never reported as success later.
TEST(Handle, FinishStepsRunOnceAndAFailureSticks) {
  int first = 0, second = 0;
  Handle h(
      c10::intrusive_ptr<compat::Work>(), [&] { ++first; }, "test op", std::chrono::milliseconds(1000));
  Handle chained = std::move(h).then([&] {
    ++second;
    throw std::runtime_error("post step failed");
  });
  EXPECT_TRUE(h.done()) << "then() consumes the handle";
  EXPECT_THROW(chained.wait(), std::runtime_error);
  EXPECT_THROW(chained.wait(), std::runtime_error) << "a failed handle keeps failing";
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 1) << "finish steps never run twice";
  int later = 0;
  Handle done;
  Handle after_done = std::move(done).then([&] { ++later; });
  EXPECT_EQ(later, 0) << "the step runs at wait(), not at then()";
  after_done.wait();
  after_done.wait();
  EXPECT_EQ(later, 1);
}

// Moving onto a pending handle would drop its finish step (Note [Overwriting a pending Handle]): it throws, naming
// the op, and leaves both handles as they were; onto a handle that is done it moves.
TEST(Handle, MoveAssigningOntoAPendingHandleThrowsNamingItsOpAndMovesNothing) {
  int first = 0, second = 0;
  Handle pending(
      c10::intrusive_ptr<compat::Work>(), [&] { ++first; }, "all_reduce on group 'test' (rank 0 of 2)",
      std::chrono::milliseconds(1000));
  Handle other(
      c10::intrusive_ptr<compat::Work>(), [&] { ++second; }, "broadcast on group 'test' (rank 0 of 2)",
      std::chrono::milliseconds(1000));
  try {
    pending = std::move(other);
    ADD_FAILURE() << "expected std::logic_error: the pending all_reduce's finish step would be lost";
  } catch (const std::logic_error& e) {
    std::cout << "rejected: " << e.what() << "\n";
    EXPECT_NE(std::string(e.what()).find("all_reduce on group 'test' (rank 0 of 2)"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(pending.done()) << "the pending handle stays pending";
  EXPECT_FALSE(other.done()) << "nothing was moved out of the source";
  pending.wait();
  EXPECT_EQ(first, 1) << "the finish step of the handle that was kept runs at its wait()";
  pending = std::move(other);  // done now: it may be overwritten
  EXPECT_TRUE(other.done()) << "the source of a move is a completed handle";
  EXPECT_FALSE(pending.done());
  pending.wait();
  EXPECT_EQ(second, 1);
  EXPECT_EQ(first, 1);
}

// then_issue: the second collective starts at advance() (once, after the first landed), not at then_issue() and not
// only at wait(); wait() finishes both and runs the steps chained after them; a plain handle's advance() is its
// wait(); a failing issue() sticks and is never retried. Two ranks, two groups: the order of each group's
// collectives is the same on both.
TEST(Handle, ThenIssueStartsTheSecondCollectiveAtAdvanceOnceAndWaitFinishesBoth) {
  run_world(
      2,
      [](World& world) {
        Communicator& all = world.world();
        Communicator& other = world.group("pair", {0, 1});
        const double r = all.rank() + 1;
        at::Tensor x = at::full({4}, r), y = at::full({3}, 10 * r);
        std::vector<std::string> steps;
        const size_t start = all.recorder().size();
        Handle chained = all.all_reduce(x)
                             .then_issue([&] {
                               steps.push_back("issue");
                               return other.all_reduce(y);
                             })
                             .then([&] { steps.push_back("after"); });
        EXPECT_TRUE(steps.empty()) << "nothing is issued before advance()";
        EXPECT_FALSE(chained.done());
        chained.advance();
        chained.advance();
        EXPECT_EQ(steps, std::vector<std::string>{"issue"}) << "advance() issues the second collective once";
        EXPECT_TRUE(at::equal(x, at::full({4}, 3.0))) << "the first collective landed before the second was issued";
        EXPECT_FALSE(chained.done()) << "the second is still to be waited for";
        chained.wait();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "after"}));
        EXPECT_TRUE(at::equal(y, at::full({3}, 30.0))) << y;
        std::vector<std::string> groups;
        for (const auto& rec : all.recorder().since(start)) groups.push_back(rec.group);
        EXPECT_EQ(groups, (std::vector<std::string>{all.name(), other.name()})) << "first on the world, then the pair";

        Handle plain = all.all_reduce(x);
        plain.advance();
        EXPECT_TRUE(plain.done()) << "a one-collective handle's advance() is its wait()";

        int issued = 0;
        Handle failing = all.all_reduce(x).then_issue([&]() -> Handle {
          ++issued;
          throw std::runtime_error("issue failed");
        });
        EXPECT_THROW(failing.advance(), std::runtime_error);
        EXPECT_THROW(failing.advance(), std::runtime_error) << "the failure sticks";
        EXPECT_THROW(failing.wait(), std::runtime_error) << "and wait() reports it";
        EXPECT_EQ(issued, 1) << "a failed issue() is never retried";
      },
      test_group());
}

// on_advance: a chained handle runs the step when advance() has issued the second collective (before the second is
// waited for), exactly once; a plain handle, or a chained one waited for without an advance, at wait().
TEST(Handle, OnAdvanceRunsOnceWhenTheFirstPhaseHasLandedOrAtWait) {
  run_world(
      2,
      [](World& world) {
        Communicator& all = world.world();
        Communicator& other = world.group("pair", {0, 1});
        at::Tensor x = at::ones({4}), y = at::ones({3});
        std::vector<std::string> steps;
        Handle chained = all.all_reduce(x)
                             .then_issue([&] {
                               steps.push_back("issue");
                               return other.all_reduce(y);
                             })
                             .on_advance([&] { steps.push_back("advanced"); })
                             .then([&] { steps.push_back("after"); });
        EXPECT_TRUE(steps.empty());
        chained.advance();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "advanced"})) << "the step runs at advance()";
        chained.advance();
        chained.wait();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "advanced", "after"})) << "and never again";

        steps.clear();
        Handle unadvanced = all.all_reduce(x)
                                .then_issue([&] {
                                  steps.push_back("issue");
                                  return other.all_reduce(y);
                                })
                                .on_advance([&] { steps.push_back("advanced"); });
        unadvanced.wait();
        EXPECT_EQ(steps, (std::vector<std::string>{"issue", "advanced"})) << "wait() without advance() runs it too";

        steps.clear();
        Handle plain =
            all.all_reduce(x).then([&] { steps.push_back("finish"); }).on_advance([&] { steps.push_back("advanced"); });
        plain.advance();
        EXPECT_EQ(steps, (std::vector<std::string>{"finish", "advanced"})) << "a plain handle: after its own finish";
      },
      test_group());
}

// comm_time: busy is the union of the closed collectives' spans, exposed the part of it inside the waits (their
// union too), both clipped to the window; a pending collective (end 0) counts for nothing.
TEST(CommTime, BusyIsTheUnionOfTheSpansAndExposedItsPartInsideTheWaitsWithinTheWindow) {
  auto span = [](int64_t start, int64_t end) {
    CollectiveRecord r;
    r.op = "all_reduce";
    r.start_ns = start;
    r.end_ns = end;
    return r;
  };
  auto wait = [](int64_t start, int64_t end) { return WaitRecord{"ddp sync", start, end}; };
  // Window [100, 200). Collectives, out of order: [190, 250) is cut to [190, 200); [90, 120) and [110, 130)
  // overlap: [100, 130); [150, 160); [170, pending) and [300, 400) count for nothing. Busy: 30 + 10 + 10 = 50.
  const std::vector<CollectiveRecord> records{span(190, 250), span(110, 130), span(300, 400),
                                              span(90, 120),  span(150, 160), span(170, 0)};
  // Waits: [115, 155) and [118, 125) (inside it, counted once) cover [115, 130) and [150, 155) of the busy time;
  // [140, 145) covers none; [195, 205) covers [195, 200). Exposed: 15 + 5 + 5 = 25.
  const std::vector<WaitRecord> waits{wait(195, 205), wait(115, 155), wait(140, 145), wait(118, 125)};
  const CommTime t = comm_time(records, waits, 100, 200);
  std::cout << "busy " << t.busy_ns << " (expected 50), exposed " << t.exposed_ns << " (expected 25)\n";
  EXPECT_EQ(t.busy_ns, 50);
  EXPECT_EQ(t.exposed_ns, 25);
  const CommTime none = comm_time(records, waits, 400, 500);
  EXPECT_EQ(none.busy_ns, 0) << "nothing in the window";
  EXPECT_EQ(none.exposed_ns, 0);
  const CommTime no_waits = comm_time(records, {}, 0, 1000);
  EXPECT_EQ(no_waits.busy_ns, 40 + 10 + 60 + 100) << "[90, 130), [150, 160), [190, 250), [300, 400)";
  EXPECT_EQ(no_waits.exposed_ns, 0) << "no wait: all of it hidden";
}

// Work done inside a wait (stage 03's optimizer steps in a handle's continuation) is cut out of the wait spans, so
// communication during it counts as hidden.
TEST(CommTime, BusySpansInsideAWaitAreNotWaiting) {
  CommRecorder rec;
  rec.record_wait("ddp sync", 100, 200);
  rec.record_wait("ddp sync", 300, 310);
  rec.record_busy(120, 130);
  rec.record_busy(150, 170);
  rec.record_busy(190, 250);  // runs past the wait's end
  rec.record_busy(300, 310);  // all of the second wait
  const std::vector<WaitRecord> waits = rec.waits();
  std::string got;
  for (const auto& w : waits) got += "[" + std::to_string(w.start_ns) + "," + std::to_string(w.end_ns) + ")";
  std::cout << "waits left: " << got << "\n";
  EXPECT_EQ(got, "[100,120)[130,150)[170,190)");
  CollectiveRecord r;
  r.op = "all_reduce";
  r.start_ns = 100;
  r.end_ns = 200;
  const CommTime t = comm_time({r}, waits, 0, 1000);
  EXPECT_EQ(t.busy_ns, 100);
  EXPECT_EQ(t.exposed_ns, 20 + 20 + 20) << "only the time the thread really waited";
}

// GroupOptions::wrap_backend: the Communicator runs on what the wrapper returns. Every collective (the rings' steps
// included) goes through it and gives the backend's result; a wrapper of another rank or size is refused by name.
TEST(WrappedBackend, CarriesEveryCollectiveAndTheRingsStepsAreToldApartByTag) {
  std::vector<test_support::DelayCounts> counts(3);
  GroupOptions options = test_group();
  options.wrap_backend = [&](c10::intrusive_ptr<compat::Backend> inner, int rank) {
    test_support::DelayPlan plan;
    plan.all_gather = plan.reduce_scatter = plan.other = std::chrono::microseconds(500);
    return c10::make_intrusive<test_support::DelayedBackend>(std::move(inner), plan, &counts[rank]);
  };
  run_ranks(
      3,
      [&](Communicator& comm) {
        const auto r = static_cast<double>(comm.rank());
        at::Tensor sum = at::full({4}, r + 1.0);
        comm.all_reduce(sum).wait();
        EXPECT_TRUE(sum.equal(at::full({4}, 6.0)));
        at::Tensor root = at::full({2}, r);
        comm.broadcast(root, 1).wait();
        EXPECT_TRUE(root.equal(at::full({2}, 1.0)));
        at::Tensor gathered = at::empty({6});
        ASSERT_TRUE(comm.all_gather_uses_ring(gathered));
        comm.all_gather(gathered, at::full({2}, r)).wait();
        EXPECT_TRUE(gathered.equal(at::tensor({0.0, 0.0, 1.0, 1.0, 2.0, 2.0}, at::kFloat)));
        at::Tensor mine = at::empty({2});
        comm.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
        comm.reduce_scatter(mine, at::arange(6, at::kFloat)).wait();
        EXPECT_TRUE(mine.equal(at::arange(2 * comm.rank(), 2 * comm.rank() + 2, at::kFloat).mul(3)));
        comm.barrier();
      },
      options);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(counts[r].all_gather, 2) << "rank " << r << ": one send per step of the 3-rank ring all-gather";
    EXPECT_EQ(counts[r].reduce_scatter, 2) << "rank " << r << ": one send per step of the ring reduce-scatter";
    EXPECT_EQ(counts[r].other, 3) << "rank " << r << ": all-reduce, broadcast, barrier";
  }
  options.wrap_backend = [](const c10::intrusive_ptr<compat::Backend>&, int) {
    return c10::intrusive_ptr<compat::Backend>();
  };
  try {
    run_ranks(
        1, [](Communicator&) {}, options);
    ADD_FAILURE() << "a wrapper that returns no backend must be refused";
  } catch (const std::runtime_error& e) {
    std::cout << e.what() << "\n";
    EXPECT_NE(std::string(e.what()).find("wrap_backend returned no backend"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardlab
