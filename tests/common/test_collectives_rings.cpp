// The Communicator's rings on real Gloo process groups, ranks as threads: the ring reduce-scatter and all-gather
// against Gloo's own, several in flight at once, kAuto's choice between them, and a wrapped backend that carries every
// collective and the rings' steps.
#include "shardlab/core/comm/thread_ranks.h"
#include "support/delayed_backend.h"
#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>

namespace shardlab {
namespace {

using test_support::test_group;

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
