// Stage 05 — robust to timing. Prefetch decides from what every rank sees alike (orders, states, the policy), never
// from whether a collective has finished (Note [Prefetching only what every rank prefetches]). So delays that differ
// from rank to rank, injected before all-gathers, before reduce-scatters (through a c10d backend wrapper), after
// the forward or before the optimizer step (on the training thread), one at a time and all at once, change neither
// the collectives a rank issues nor one bit of the parameters. A schedule that asked "has it landed yet?" would
// issue different collectives on different ranks here, and hang or fail by its timeout.
#include "shardlab/prefetch/prefetch.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/delayed_backend.h"
#include "support/group.h"
#include "support/train_config.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace shardlab::prefetch {
namespace {

using std::chrono::microseconds;

struct TimingCase {
  const char* name;
  bool all_gathers;      // before each all-gather (each step of the ring), through the backend
  bool reduce_scatters;  // before each reduce-scatter (each step of the ring), through the backend
  bool after_forward;    // on the training thread, between loss() and backward()
  bool before_step;      // on the training thread, before the optimizer step
};

std::ostream& operator<<(std::ostream& os, const TimingCase& c) { return os << c.name; }

constexpr int kWorld = 2;
constexpr microseconds kMaxDelay{4000};  // each delay is drawn from [0, 4 ms], per rank

// One rank's outcome: its parameters after training, the collectives it issued, and the delays it took.
struct Outcome {
  std::vector<at::Tensor> params;
  std::vector<std::string> collectives;  // "op wire_op numel", in issue order
  int64_t delayed_gathers = 0, delayed_reduces = 0, host_delays = 0;
};

TrainConfig config() {
  TrainConfig c = test_support::config("tiny_gpt")
                      .layers(4)
                      .steps(3)
                      .global_batch(8)
                      .micro_batches(2)
                      .optimizer("sgd")  // momentum: a wrong bit in step 1 still shows in step 3
                      .lr(0.05);
  return c;
}

// Trains `config()` with prefetch at depth 2 (limit 2) under `tc`'s delays; `tc == nullptr`: no delay at all.
std::vector<Outcome> train(const TimingCase* tc) {
  const TrainConfig c = config();
  std::vector<Outcome> out(kWorld);
  std::vector<test_support::DelayCounts> counts(kWorld);
  GroupOptions options = test_support::test_group();
  if (tc != nullptr) {
    options.wrap_backend = [&](c10::intrusive_ptr<compat::Backend> inner, int rank) {
      test_support::DelayPlan plan;
      plan.all_gather = tc->all_gathers ? kMaxDelay : microseconds(0);
      plan.reduce_scatter = tc->reduce_scatters ? kMaxDelay : microseconds(0);
      plan.seed = 11;
      return c10::make_intrusive<test_support::DelayedBackend>(std::move(inner), plan, &counts[rank]);
    };
  }
  run_ranks(
      kWorld,
      [&](Communicator& comm) {
        Outcome& mine = out[comm.rank()];
        std::mt19937 random(101U + static_cast<uint32_t>(comm.rank()));
        auto host_delay = [&](bool on) {
          if (!on) return;
          ++mine.host_delays;
          std::this_thread::sleep_for(
              microseconds(std::uniform_int_distribution<int64_t>(0, kMaxDelay.count())(random)));
        };
        fsdp::Options fo;
        fo.reshard_after_forward = true;
        fsdp::FullyShardedModel fsdp(make_model(c, at::kCPU), comm, fo);
        PrefetchPolicy policy;
        policy.forward_depth = 2;
        policy.backward_depth = 2;
        auto schedule = enable_prefetch(fsdp, policy);
        auto data = make_dataset(c.model, c.seed);
        auto opt = make_optimizer(c.optimizer, fsdp.parameters(), c.lr);
        const size_t mark = comm.recorder().size();
        for (int step = 0; step < c.steps; ++step) {
          compat::zero_grad(*opt);
          auto micro = micro_batches(rank_slice(data->global_batch(step, c.global_batch), comm.rank(), comm.size()),
                                     c.micro_batches);
          for (int i = 0; i < c.micro_batches; ++i) {
            auto pass = [&] {
              at::Tensor loss = fsdp.loss(micro[i]) / c.micro_batches;
              host_delay(tc != nullptr && tc->after_forward);
              loss.backward();
            };
            if (i + 1 < c.micro_batches) {
              auto scope = fsdp.no_sync();
              pass();
            } else {
              pass();
            }
          }
          host_delay(tc != nullptr && tc->before_step);
          opt->step();
        }
        for (const auto& r : comm.recorder().since(mark))
          mine.collectives.push_back(r.op + " " + r.wire_op + " " + std::to_string(r.numel));
        for (const auto& p : fsdp.full_parameters()) mine.params.push_back(p.detach().clone());
        EXPECT_GT(schedule->issued(), 0u) << "depth 2 must prefetch, or this tests nothing";
      },
      options);
  for (int r = 0; r < kWorld; ++r) {
    out[r].delayed_gathers = counts[r].all_gather;
    out[r].delayed_reduces = counts[r].reduce_scatter;
  }
  return out;
}

// Where two sequences of collectives first differ, for the failure message.
std::string first_difference(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  if (i == a.size() && i == b.size()) return "none";
  return "collective #" + std::to_string(i) + ": '" + (i < a.size() ? a[i] : "(none)") + "' against '" +
         (i < b.size() ? b[i] : "(none)") + "'";
}

class PrefetchTiming : public ::testing::TestWithParam<TimingCase> {};

TEST_P(PrefetchTiming, DelaysOnEachRankChangeNoCollectiveAndNoBit) {
  const TimingCase& tc = GetParam();
  const std::vector<Outcome> clean = train(nullptr);
  const std::vector<Outcome> delayed = train(&tc);
  for (int r = 0; r < kWorld; ++r) {
    const Outcome& d = delayed[r];
    std::cout << tc << " rank " << r << ": delayed " << d.delayed_gathers << " all-gather steps, " << d.delayed_reduces
              << " reduce-scatter steps, " << d.host_delays << " times on the training thread; " << d.collectives.size()
              << " collectives\n";
    // The delays really happened, where the case puts them.
    if (tc.all_gathers) EXPECT_GT(d.delayed_gathers, 0) << "rank " << r << ": no all-gather was delayed";
    if (tc.reduce_scatters) EXPECT_GT(d.delayed_reduces, 0) << "rank " << r << ": no reduce-scatter was delayed";
    if (tc.after_forward || tc.before_step) EXPECT_GT(d.host_delays, 0) << "rank " << r;
    EXPECT_EQ(d.collectives, clean[r].collectives)
        << "rank " << r << ": the delays changed which collectives were issued, or their order; first difference, "
        << first_difference(d.collectives, clean[r].collectives)
        << " (a schedule that decides from timing, not from what every rank sees alike?)";
    EXPECT_EQ(d.collectives, delayed[0].collectives) << "rank " << r << " issued other collectives than rank 0; "
                                                     << first_difference(d.collectives, delayed[0].collectives);
    const double diff = max_abs_diff(d.params, clean[r].params);
    EXPECT_EQ(diff, 0.0) << "rank " << r << ": max |param with delays - without| = " << diff;
  }
}

INSTANTIATE_TEST_SUITE_P(Stage05, PrefetchTiming,
                         ::testing::Values(TimingCase{"all_gathers", true, false, false, false},
                                           TimingCase{"reduce_scatters", false, true, false, false},
                                           TimingCase{"after_forward", false, false, true, false},
                                           TimingCase{"before_step", false, false, false, true},
                                           TimingCase{"all_at_once", true, true, true, true}),
                         [](const ::testing::TestParamInfo<TimingCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace shardlab::prefetch
