// Stage 03 — the asynchronous ReduceScatterBucketer. N ranks (threads, real Gloo): small inputs must share one
// collective, large ones go at once, full buckets launch without waiting, every callback gets exactly its chunk of
// the sum, and teardown frees the buffers (or refuses while work is pending).
#include "shardlab/comm_hooks/reduce_scatter_bucketer.h"
#include "shardlab/core/comm/process_group.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "support/delayed_backend.h"
#include "support/group.h"
#include "support/rank_zero_first.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace shardlab::comm_hooks {
namespace {

using test_support::test_group;

// Rank r's input number `i`: world * shard elements. Integer-valued by default, so sums in any order are exact
// and results can be compared with at::equal at any world size; `normal` gives N(0, 1) values instead.
at::Tensor input_of(int rank, int i, int world, int64_t shard, c10::ScalarType dtype = at::kFloat,
                    bool normal = false) {
  auto gen = at::detail::createCPUGenerator(100 * static_cast<uint64_t>(i) + static_cast<uint64_t>(rank) + 1);
  at::Tensor t = normal ? at::normal(0.0, 1.0, {world * shard}, gen)
                        : at::randint(-1000, 1000, {world * shard}, gen, at::TensorOptions().dtype(at::kLong));
  return t.to(dtype);
}

// What rank `rank` must receive for input `i`: chunk `rank` of the sum over ranks (computed in double).
at::Tensor expected_chunk(int rank, int i, int world, int64_t shard, c10::ScalarType dtype = at::kFloat) {
  at::Tensor sum = at::zeros({world * shard}, at::kDouble);
  for (int r = 0; r < world; ++r) sum += input_of(r, i, world, shard, dtype).to(at::kDouble);
  return sum.view({world, shard})[rank].to(dtype);
}

// Collects what each callback received (a copy: the view is valid during the callback only) and in which order.
struct Results {
  std::vector<at::Tensor> got;
  std::vector<int> order;
  ReduceScatterBucketer::Callback slot(int i) {
    if (static_cast<int>(got.size()) <= i) got.resize(i + 1);
    return [this, i](const at::Tensor& chunk) {
      got[i] = chunk.clone();
      order.push_back(i);
    };
  }
};

double check_results(const Results& res, int rank, int world, const std::vector<int64_t>& shards,
                     const std::vector<c10::ScalarType>& dtypes = {}) {
  double max_diff = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const c10::ScalarType dt = dtypes.empty() ? at::kFloat : dtypes[i];
    const at::Tensor want = expected_chunk(rank, static_cast<int>(i), world, shards[i], dt);
    EXPECT_TRUE(res.got[i].defined()) << "callback " << i << " never ran";
    if (!res.got[i].defined()) continue;
    EXPECT_EQ(res.got[i].scalar_type(), dt);
    EXPECT_EQ(res.got[i].numel(), shards[i]);
    const double diff = (res.got[i].to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    max_diff = std::max(max_diff, diff);
    EXPECT_TRUE(at::equal(res.got[i], want)) << "rank " << rank << " input " << i << " differs by " << diff;
  }
  return max_diff;
}

// check_results on 2 ranks; rank 0 then prints "`what`; max |chunk - exact sum| = " and the largest difference.
void check_and_report(const Results& res, Communicator& comm, const std::vector<int64_t>& shards,
                      const std::string& what, const std::vector<c10::ScalarType>& dtypes = {}) {
  const double diff = check_results(res, comm.rank(), 2, shards, dtypes);
  if (comm.rank() == 0) std::cout << what << "; max |chunk - exact sum| = " << diff << "\n";
}

TEST(Bucketer, SmallInputsShareOneCollectiveAfterFlush) {
  for (int world : {2, 3}) {
    const std::vector<int64_t> shards{5, 7, 3};
    run_ranks(
        world,
        [&](Communicator& comm) {
          ReduceScatterBucketer bucketer;  // 25 MiB: everything fits
          Results res;
          const size_t mark = comm.recorder().size();
          for (int i = 0; i < 3; ++i)
            bucketer.reduce_scatter_async(input_of(comm.rank(), i, world, shards[i]), comm, res.slot(i));
          EXPECT_EQ(comm.recorder().size(), mark) << "nothing is sent before flush";
          EXPECT_EQ(bucketer.pending_callbacks(), 3u);
          EXPECT_TRUE(res.order.empty()) << "callbacks run in flush() only";
          bucketer.flush();
          const auto recs = comm.recorder().since(mark);
          ASSERT_EQ(recs.size(), 1u) << "three small inputs, one collective";
          EXPECT_EQ(recs[0].op, "reduce_scatter");
          EXPECT_EQ(recs[0].reduce, "sum");
          EXPECT_EQ(recs[0].numel, world * (5 + 7 + 3)) << "world * the sum of the shards";
          EXPECT_EQ(res.order, (std::vector<int>{0, 1, 2})) << "submission order";
          EXPECT_EQ(bucketer.pending_callbacks(), 0u);
          EXPECT_EQ(bucketer.in_flight(), 0u);
          const double diff = check_results(res, comm.rank(), world, shards);
          if (comm.rank() == 0)
            std::cout << "world " << world << ": 3 inputs -> " << recs.size() << " collective of " << recs[0].numel
                      << " elements (wire " << recs[0].wire_op << "), max |chunk - exact sum| = " << diff << "\n";
        },
        test_group());
  }
}

// Real-valued data, world 2 (one addition, so any order gives the same bits): the bucketed result equals a direct
// Communicator::reduce_scatter of each input.
TEST(Bucketer, MatchesADirectReduceScatter) {
  const std::vector<int64_t> shards{11, 4, 9, 1};
  run_ranks(
      2,
      [&](Communicator& comm) {
        ReduceScatterBucketer bucketer;
        Results res;
        std::vector<at::Tensor> inputs;
        for (size_t i = 0; i < shards.size(); ++i) {
          inputs.push_back(input_of(comm.rank(), static_cast<int>(i), 2, shards[i], at::kFloat, /*normal=*/true));
          bucketer.reduce_scatter_async(inputs.back(), comm, res.slot(static_cast<int>(i)));
        }
        bucketer.flush();
        double max_diff = 0;
        for (size_t i = 0; i < shards.size(); ++i) {
          at::Tensor direct = at::empty({shards[i]});
          comm.reduce_scatter(direct, inputs[i]).wait();
          max_diff = std::max(max_diff, (res.got[i] - direct).abs().max().item<double>());
          EXPECT_TRUE(at::equal(res.got[i], direct)) << "input " << i;
        }
        if (comm.rank() == 0) std::cout << "max |bucketed - direct reduce_scatter| = " << max_diff << "\n";
      },
      test_group());
}

TEST(Bucketer, LargeInputIsSentAtOnce) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        ReduceScatterBucketer bucketer(256);  // 256 B / 4 B / 2 ranks = 32 elements per rank
        ASSERT_EQ(bucketer.shard_capacity(at::kFloat, 2), 32);
        Results res;
        const std::vector<int64_t> shards{6, 40, 4};
        const size_t mark = comm.recorder().size();
        bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, shards[0]), comm, res.slot(0));
        EXPECT_EQ(comm.recorder().size(), mark);
        bucketer.reduce_scatter_async(input_of(comm.rank(), 1, 2, shards[1]), comm, res.slot(1));  // 40 > 32
        const auto before = comm.recorder().since(mark);
        ASSERT_EQ(before.size(), 1u) << "the large input is launched at once, before flush";
        EXPECT_EQ(before[0].numel, 2 * 40);
        EXPECT_EQ(bucketer.in_flight(), 1u);
        EXPECT_TRUE(res.order.empty()) << "its callback waits for flush()";
        bucketer.reduce_scatter_async(input_of(comm.rank(), 2, 2, shards[2]), comm, res.slot(2));
        EXPECT_EQ(comm.recorder().size(), mark + 1) << "the small ones still share the open bucket";
        bucketer.flush();
        const auto recs = comm.recorder().since(mark);
        ASSERT_EQ(recs.size(), 2u);
        EXPECT_EQ(recs[1].numel, 2 * (6 + 4));
        EXPECT_EQ(res.order, (std::vector<int>{1, 0, 2})) << "launch order: the large input went first";
        check_and_report(res, comm, shards, "large input sent at once");
      },
      test_group());
}

TEST(Bucketer, DtypesGetSeparateBuckets) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        ReduceScatterBucketer bucketer;
        Results res;
        const std::vector<int64_t> shards{3, 5, 4, 2};
        const std::vector<c10::ScalarType> dtypes{at::kFloat, at::kDouble, at::kFloat, at::kDouble};
        const size_t mark = comm.recorder().size();
        for (int i = 0; i < 4; ++i)
          bucketer.reduce_scatter_async(input_of(comm.rank(), i, 2, shards[i], dtypes[i]), comm, res.slot(i));
        EXPECT_EQ(bucketer.num_buckets(), 2u);
        bucketer.flush();
        const auto recs = comm.recorder().since(mark);
        ASSERT_EQ(recs.size(), 2u) << "one collective per dtype";
        EXPECT_EQ(recs[0].dtype, at::kFloat);
        EXPECT_EQ(recs[0].numel, 2 * (3 + 4));
        EXPECT_EQ(recs[1].dtype, at::kDouble);
        EXPECT_EQ(recs[1].numel, 2 * (5 + 2));
        EXPECT_EQ(res.order, (std::vector<int>{0, 2, 1, 3})) << "bucket by bucket, submission order within";
        check_and_report(res, comm, shards, "f32 + f64 -> 2 collectives", dtypes);
      },
      test_group());
}

TEST(Bucketer, AFullBucketIsLaunchedWithoutWaitingAndBuffersAreReused) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        ReduceScatterBucketer bucketer(64);  // 64 B / 4 B / 2 ranks = 8 elements per rank
        ASSERT_EQ(bucketer.shard_capacity(at::kFloat, 2), 8);
        const std::vector<int64_t> shards{5, 5, 3};
        int64_t first_round_bytes = 0;
        for (int round = 0; round < 2; ++round) {
          Results res;
          const size_t mark = comm.recorder().size();
          bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, shards[0]), comm, res.slot(0));
          EXPECT_EQ(comm.recorder().size(), mark);
          bucketer.reduce_scatter_async(input_of(comm.rank(), 1, 2, shards[1]), comm, res.slot(1));  // 5 > 8 - 5
          auto recs = comm.recorder().since(mark);
          ASSERT_EQ(recs.size(), 1u) << "the full bucket is launched when the next input does not fit";
          EXPECT_EQ(recs[0].numel, 2 * 5);
          EXPECT_EQ(bucketer.in_flight(), 1u);
          EXPECT_TRUE(res.order.empty()) << "launched, not waited for: callbacks run in flush()";
          bucketer.reduce_scatter_async(input_of(comm.rank(), 2, 2, shards[2]), comm, res.slot(2));  // 5 + 3 fits
          EXPECT_EQ(comm.recorder().size(), mark + 1);
          bucketer.flush();
          recs = comm.recorder().since(mark);
          ASSERT_EQ(recs.size(), 2u);
          EXPECT_EQ(recs[1].numel, 2 * (5 + 3));
          EXPECT_EQ(res.order, (std::vector<int>{0, 1, 2}));
          const int64_t bytes = bucketer.allocated_bytes();
          if (round == 0) {
            // Two buffers of (2 rows + 1 output) * 8 floats: the one in flight and the one that replaced it.
            EXPECT_EQ(bytes, 2 * (2 * 8 + 8) * 4);
            first_round_bytes = bytes;
          } else {
            EXPECT_EQ(bytes, first_round_bytes) << "the second round reuses the buffers";
          }
          check_and_report(res, comm, shards,
                           "round " + std::to_string(round) + ": bucket filled -> launched early; " +
                               std::to_string(bytes) + " bytes of buffers");
        }
      },
      test_group());
}

TEST(Bucketer, TeardownFreesBuffersAndRefusesPendingWork) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        ReduceScatterBucketer bucketer(256);
        Results res;
        bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, 6), comm, res.slot(0));
        bucketer.reduce_scatter_async(input_of(comm.rank(), 1, 2, 40), comm, res.slot(1));  // large: in flight
        try {
          bucketer.teardown();
          ADD_FAILURE() << "teardown with pending work must throw";
        } catch (const std::logic_error& e) {
          if (comm.rank() == 0) std::cout << "teardown while pending: " << e.what() << "\n";
          EXPECT_NE(std::string(e.what()).find("flush()"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("2 reduce-scatter(s) still pending"), std::string::npos) << e.what();
        }
        bucketer.flush();
        check_results(res, comm.rank(), 2, {6, 40});
        const std::vector<at::Tensor> held = bucketer.buffers();
        ASSERT_FALSE(held.empty());
        EXPECT_GT(bucketer.allocated_bytes(), 0);
        bucketer.teardown();
        EXPECT_EQ(bucketer.allocated_bytes(), 0);
        for (const auto& t : held) EXPECT_EQ(t.storage().nbytes(), 0u) << "storage freed, even if someone holds it";
        // Usable again: buffers grow back on the next use.
        Results again;
        bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, 6), comm, again.slot(0));
        bucketer.flush();
        check_results(again, comm.rank(), 2, {6});
        EXPECT_GT(bucketer.allocated_bytes(), 0);
        if (comm.rank() == 0)
          std::cout << held.size() << " buffers freed by teardown, " << bucketer.allocated_bytes()
                    << " bytes after reuse\n";
      },
      test_group());
}

TEST(Bucketer, NonPositiveCapSendsEverythingAtOnce) {
  for (int64_t cap : {0, -1}) {
    run_ranks(
        2,
        [&](Communicator& comm) {
          ReduceScatterBucketer bucketer(cap);
          EXPECT_EQ(bucketer.shard_capacity(at::kFloat, 2), 0);
          Results res;
          const std::vector<int64_t> shards{1, 2, 3};
          const size_t mark = comm.recorder().size();
          for (int i = 0; i < 3; ++i) {
            bucketer.reduce_scatter_async(input_of(comm.rank(), i, 2, shards[i]), comm, res.slot(i));
            EXPECT_EQ(comm.recorder().size(), mark + i + 1) << "input " << i << " is sent at once";
          }
          EXPECT_EQ(bucketer.in_flight(), 3u);
          EXPECT_EQ(bucketer.num_buckets(), 0u);
          bucketer.flush();
          EXPECT_EQ(res.order, (std::vector<int>{0, 1, 2}));
          const double diff = check_results(res, comm.rank(), 2, shards);
          if (comm.rank() == 0) std::cout << "cap " << cap << ": 3 inputs -> 3 collectives; max diff " << diff << "\n";
        },
        test_group());
  }
}

TEST(Bucketer, RejectsBadInputsClearly) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        ReduceScatterBucketer bucketer;
        auto message = [&](const at::Tensor& t) -> std::string {
          try {
            bucketer.reduce_scatter_async(t, comm, nullptr);
          } catch (const std::invalid_argument& e) {
            return e.what();
          }
          return "";
        };
        const std::string odd = message(at::ones({7}));
        if (comm.rank() == 0) std::cout << "error: " << odd << "\n";
        EXPECT_NE(odd.find("7 elements, not a multiple of 2"), std::string::npos) << odd;
        EXPECT_NE(message(at::ones({4}, at::kBool)).find("Bool"), std::string::npos);
        EXPECT_NE(message(at::Tensor()).find("undefined"), std::string::npos);
        EXPECT_EQ(bucketer.pending_callbacks(), 0u) << "a rejected input queues nothing";
        // A null callback is allowed; the bucketer still works after the errors.
        Results res;
        bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, 3), comm, nullptr);
        bucketer.reduce_scatter_async(input_of(comm.rank(), 1, 2, 3), comm, res.slot(1));
        bucketer.flush();
        ASSERT_EQ(res.order, (std::vector<int>{1})) << "only the second input has a callback";
        EXPECT_TRUE(at::equal(res.got[1], expected_chunk(comm.rank(), 1, 2, 3))) << "rank " << comm.rank();
      },
      test_group());
}

// Nothing waits when something is launched: rank 0 makes its calls while the other rank waits for them to return (30 s
// at most) before it makes its own, so none of rank 0's collectives can have completed. On the way: an input whose
// shard equals the capacity fits (it is not large), and a bucket that is merely full is not launched until an input
// does not fit in it.
TEST(Bucketer, LaunchingABucketOrALargeInputNeverWaits) {
  std::atomic<bool> returned{false};
  run_ranks(
      2,
      [&](Communicator& comm) {
        ReduceScatterBucketer bucketer(64);  // 8 elements per rank
        const std::vector<int64_t> shards{8, 3, 20};
        Results res;
        auto calls = [&] {
          const size_t mark = comm.recorder().size();
          bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, shards[0]), comm, res.slot(0));
          EXPECT_EQ(comm.recorder().size(), mark)
              << "an input whose shard (8) equals the capacity goes into the bucket, and a bucket that is merely "
                 "full waits for the next input or flush(): nothing is sent yet";
          bucketer.reduce_scatter_async(input_of(comm.rank(), 1, 2, shards[1]), comm, res.slot(1));
          EXPECT_EQ(comm.recorder().size(), mark + 1) << "the full bucket is launched when the next input does not fit";
          bucketer.reduce_scatter_async(input_of(comm.rank(), 2, 2, shards[2]), comm, res.slot(2));
          EXPECT_EQ(comm.recorder().size(), mark + 2) << "the large input is launched at once";
        };
        test_support::rank_zero_first(
            comm, returned,
            "rank 0's reduce_scatter_async calls (a bucket launched, a large input launched) "
            "had not returned 30 s later, while rank 1 had issued nothing: launching must not "
            "wait for the collective; only flush() waits",
            calls);
        EXPECT_TRUE(res.order.empty()) << "callbacks run in flush() only";
        bucketer.flush();
        EXPECT_EQ(res.order, (std::vector<int>{0, 2, 1})) << "launch order: the full bucket, the large input, the rest";
        check_results(res, comm.rank(), 2, shards);
      },
      test_group());
}

// A backend that forwards every op to a real one (a DelayedBackend without delays), except that it fails (at once, on
// every rank alike) or slows down (a fixed delay) the steps of chosen ring reduce-scatters, told apart by their tag
// (ring number * 4096 + step).
struct RingFaults {
  int64_t fail = -1;  // the ring reduce-scatter (0 = the group's first) whose send throws
  int64_t slow = -1;  // the ring reduce-scatter whose send waits `delay` first
  std::chrono::milliseconds delay{300};
};

class FaultyBackend : public test_support::DelayedBackend {
 public:
  FaultyBackend(c10::intrusive_ptr<compat::Backend> inner, const RingFaults& faults)
      : DelayedBackend(std::move(inner), test_support::DelayPlan{}, nullptr), faults_(faults) {}
  c10::intrusive_ptr<compat::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    if (tag < kRingAllGatherTagBase) {
      const int64_t ring = tag / 4096;
      if (ring == faults_.fail)
        throw std::runtime_error("injected failure of ring reduce-scatter " + std::to_string(ring));
      if (ring == faults_.slow) std::this_thread::sleep_for(faults_.delay);
    }
    return DelayedBackend::send(t, dst, tag);
  }

 private:
  RingFaults faults_;
};

GroupOptions faulty_group(const RingFaults& faults) {
  GroupOptions options = test_group();
  options.wrap_backend = [faults](c10::intrusive_ptr<compat::Backend> inner,
                                  int) -> c10::intrusive_ptr<compat::Backend> {
    return c10::make_intrusive<FaultyBackend>(std::move(inner), faults);
  };
  return options;
}

// True when every collective recorded since `mark` has completed.
bool all_completed(Communicator& comm, size_t mark) {
  for (const auto& r : comm.recorder().since(mark))
    if (r.end_ns == 0) return false;
  return true;
}

// Callbacks run after their collective completed (its reduce-scatter is slowed down by 300 ms, so a callback run
// before the wait would see it pending). When one collective fails, flush() still waits for every other one, runs
// no callback, returns every bucket buffer to its bucket and rethrows the failure; the next round reuses the buffer.
TEST(Bucketer, CallbacksFollowTheirCollectiveAndAFailedFlushStillSettlesEverything) {
  RingFaults slow;
  slow.slow = 0;
  run_ranks(
      2,
      [&](Communicator& comm) {
        comm.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
        ReduceScatterBucketer bucketer(256);
        const size_t mark = comm.recorder().size();
        int ran = 0;
        bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, 6), comm, [&](const at::Tensor& chunk) {
          ++ran;
          EXPECT_TRUE(all_completed(comm, mark)) << "a callback ran before its collective had completed";
          EXPECT_TRUE(at::equal(chunk, expected_chunk(comm.rank(), 0, 2, 6))) << "rank " << comm.rank();
        });
        bucketer.flush();
        EXPECT_EQ(ran, 1);
      },
      faulty_group(slow));

  RingFaults faults;
  faults.fail = 0;  // the large input's reduce-scatter, launched first
  faults.slow = 1;  // the bucket's, launched by flush(): still in flight when the failure is known
  run_ranks(
      2,
      [&](Communicator& comm) {
        comm.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kRing);
        ReduceScatterBucketer bucketer(256);  // 32 elements per rank
        const int64_t bucket_bytes = (2 * 32 + 32) * 4;
        Results res;
        const size_t mark = comm.recorder().size();
        bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, 40), comm, res.slot(0));  // large: ring 0, fails
        bucketer.reduce_scatter_async(input_of(comm.rank(), 1, 2, 6), comm, res.slot(1));   // bucket: ring 1, slow
        std::string error;
        try {
          bucketer.flush();
        } catch (const std::runtime_error& e) {
          error = e.what();
        }
        if (comm.rank() == 0) std::cout << "flush after a failed collective: " << error << "\n";
        EXPECT_NE(error.find("injected failure"), std::string::npos)
            << "flush() must rethrow the failed collective's error; got '" << error << "'";
        EXPECT_TRUE(all_completed(comm, mark))
            << "flush() rethrew while a collective was still in flight: it must wait for every other one first";
        EXPECT_TRUE(res.order.empty()) << "no callback runs when a collective of the flush failed; " << res.order.size()
                                       << " ran";
        EXPECT_EQ(bucketer.pending_callbacks(), 0u);
        EXPECT_EQ(bucketer.in_flight(), 0u);
        EXPECT_EQ(bucketer.allocated_bytes(), bucket_bytes)
            << "the bucket's buffer (" << bucket_bytes << " bytes) goes back to its bucket even when the flush failed";
        // The next round works and reuses that buffer.
        Results again;
        bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, 6), comm, again.slot(0));
        bucketer.flush();
        check_results(again, comm.rank(), 2, {6});
        EXPECT_EQ(bucketer.allocated_bytes(), bucket_bytes) << "the spare buffer is reused";
      },
      faulty_group(faults));
}

// Destroying a bucketer with collectives in flight waits for them (they write into its buffers) and drops the
// callbacks; nothing hangs and nothing is written after the buffers are gone.
TEST(Bucketer, DestructorWaitsForWorkInFlight) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        bool called = false;
        {
          ReduceScatterBucketer bucketer(0);
          bucketer.reduce_scatter_async(input_of(comm.rank(), 0, 2, 1000), comm,
                                        [&](const at::Tensor&) { called = true; });
          EXPECT_EQ(bucketer.in_flight(), 1u);
        }
        EXPECT_FALSE(called);
        // The group is still in step: another collective completes.
        at::Tensor t = at::ones({3});
        comm.all_reduce(t).wait();
        EXPECT_TRUE(at::equal(t, at::full({3}, 2.0f)));
      },
      test_group());
}

}  // namespace
}  // namespace shardlab::comm_hooks
