// Stage 02 — bucket caps from a cost model. The fit, the replayed timeline and the choice are checked against
// figures worked out independently: a line through known points, a backward worked by hand, and an exhaustive
// search over the grid written here from the model's definition, not with the module's own functions.
#include "shardlab/bucketed_ddp/auto_caps.h"
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/bucketed_ddp/cap_tuning.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "stage02/bucketed_ddp_support.h"
#include "support/gradients.h"
#include "support/group.h"
#include "support/temp_dir.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <limits>

namespace shardlab::bucketed_ddp {
namespace {

using test_support::test_group;

TEST(CapTuning, FitRecoversAlphaAndBetaOfALine) {
  // 30 us + 2 ns/byte, exactly
  const LinkCost c = fit_link_cost({{1000, 32000}, {11000, 52000}, {101000, 232000}});
  std::cout << "alpha " << c.alpha_ns << " ns (expected 30000), beta " << c.beta_ns_per_byte << " ns/B (expected 2)\n";
  EXPECT_NEAR(c.alpha_ns, 30000, 1e-6);
  EXPECT_NEAR(c.beta_ns_per_byte, 2, 1e-12);
  EXPECT_DOUBLE_EQ(c.ns(500), 31000);
  EXPECT_THROW(fit_link_cost({{1000, 1}, {1000, 2}}), std::invalid_argument) << "one size cannot give a slope";
  const LinkCost falling = fit_link_cost({{1000, 500}, {2000, 100}});
  EXPECT_EQ(falling.beta_ns_per_byte, 0) << "a negative slope is clamped";
}

// Three parameters of 400, 800 and 1200 bytes, ready at 100, 200 and 300 ns (in that order), backward ends at 300;
// alpha 50, beta 0.1 ns/byte.
BackwardProfile three() {
  return {{at::zeros({100}), at::zeros({200}), at::zeros({300})}, {100, 200, 300}, {0, 1, 2}, 300};
}

TEST(CapTuning, TimelineMatchesABackwardWorkedByHand) {
  const LinkCost cost{50, 0.1};
  // One bucket: ready 300, runs 300..(300 + 50 + 240) = 590: exposed 290.
  EXPECT_DOUBLE_EQ(modelled_exposed_ns(three(), {1 << 20, 1 << 20}, cost), 290);
  // One bucket each (caps of 1 byte): [100, 100+50+40=190], [200, 200+50+80=330], [330, 330+50+120=500]: 200.
  EXPECT_DOUBLE_EQ(modelled_exposed_ns(three(), {1, 1}, cost), 200);
  // First cap 400 B: {0} then {1, 2}: [100, 190], then ready 300: [300, 300+50+200=550]: 250.
  EXPECT_DOUBLE_EQ(modelled_exposed_ns(three(), {400, 1 << 20}, cost), 250);
  // A slow link: one bucket each queues behind the one before: [100, 1140], [1140, 2220], [2220, 3340]: exposed
  // 3040; the single bucket runs [300, 1540]: 1240, now the better choice.
  const LinkCost slow{1000, 0.1};
  EXPECT_DOUBLE_EQ(modelled_exposed_ns(three(), {1, 1}, slow), 3040);
  EXPECT_DOUBLE_EQ(modelled_exposed_ns(three(), {1 << 20, 1 << 20}, slow), 1240);
}

// The test's own replay, from the model's definition: buckets by the cap rule over the order (one dtype here), then
// in-order launches on one serial link.
double replay(const std::vector<int64_t>& bytes, const std::vector<int64_t>& ready, int64_t end, int64_t first,
              int64_t later, double alpha, double beta, size_t* buckets) {
  double launch = -1e300, done = -1e300;
  int64_t held = 0, cap = first;
  double latest = -1e300;
  *buckets = 0;
  auto close = [&] {
    launch = std::max(launch, latest);
    done = std::max(done, launch) + alpha + beta * static_cast<double>(held);
    ++*buckets;
    held = 0;
    latest = -1e300;
    cap = later;
  };
  for (size_t i = 0; i < bytes.size(); ++i) {
    held += bytes[i];
    latest = std::max(latest, static_cast<double>(ready[i]));
    if (held >= cap) close();
  }
  if (held > 0) close();
  return std::max(0.0, done - static_cast<double>(end));
}

TEST(CapTuning, ChoiceIsTheExhaustiveSearchsBestOnTwoLinks) {
  // 12 gradients, sizes 0.5-24 KiB, ready every 40 us in order; backward ends with the last one.
  const std::vector<int64_t> numel{128, 6144, 256, 4096, 512, 2048, 128, 6144, 1024, 3072, 256, 4096};
  BackwardProfile p;
  std::vector<int64_t> bytes;
  for (size_t i = 0; i < numel.size(); ++i) {
    p.params.push_back(at::zeros({numel[i]}));
    p.ready_ns.push_back(static_cast<int64_t>(i) * 40000);
    p.order.push_back(i);
    bytes.push_back(numel[i] * 4);
  }
  p.end_ns = p.ready_ns.back();
  const std::vector<int64_t> grid{1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10};
  std::vector<BucketCaps> picks;
  for (const LinkCost cost : {LinkCost{200000, 0.5}, LinkCost{5000, 4.0}}) {  // latency-bound, bandwidth-bound
    double best = std::numeric_limits<double>::infinity();
    size_t best_buckets = 0;
    for (int64_t f : grid)
      for (int64_t l : grid) {
        size_t n = 0;
        const double e = replay(bytes, p.ready_ns, p.end_ns, f, l, cost.alpha_ns, cost.beta_ns_per_byte, &n);
        if (e < best || (e == best && n < best_buckets)) {
          best = e;
          best_buckets = n;
        }
      }
    const BucketCaps chosen = choose_caps(p, cost, grid);
    size_t n = 0;
    const double got =
        replay(bytes, p.ready_ns, p.end_ns, chosen.first_bytes, chosen.bytes, cost.alpha_ns, cost.beta_ns_per_byte, &n);
    std::cout << "alpha " << cost.alpha_ns / 1e3 << " us, beta " << cost.beta_ns_per_byte << " ns/B: chose "
              << chosen.first_bytes / 1024 << "/" << chosen.bytes / 1024 << " KiB, " << n << " buckets, exposed "
              << got / 1e3 << " us; exhaustive best " << best / 1e3 << " us with " << best_buckets << " buckets\n";
    EXPECT_DOUBLE_EQ(got, best);
    EXPECT_EQ(n, best_buckets) << "ties go to fewer buckets";
    EXPECT_DOUBLE_EQ(modelled_exposed_ns(p, chosen, cost), got) << "the module's replay agrees with the test's";
    picks.push_back(chosen);
  }
  EXPECT_TRUE(picks[0].first_bytes != picks[1].first_bytes || picks[0].bytes != picks[1].bytes)
      << "a latency-bound and a bandwidth-bound link must not get the same caps here";
  EXPECT_THROW(choose_caps(BackwardProfile{}, LinkCost{}), std::invalid_argument);
  EXPECT_THROW(choose_caps(p, LinkCost{}, {0}), std::invalid_argument);

  // The caps in use are kept unless the grid's pick models strictly less exposure; the grid need not hold them.
  const LinkCost latency{200000, 0.5};
  size_t n = 0;
  const BucketCaps one_bucket{256 << 10, 256 << 10}, tiny{1 << 10, 1 << 10};
  const double e_one = replay(bytes, p.ready_ns, p.end_ns, one_bucket.first_bytes, one_bucket.bytes, latency.alpha_ns,
                              latency.beta_ns_per_byte, &n);
  const std::vector<int64_t> small_grid{1 << 10, 4 << 10};
  const BucketCaps grid_pick = choose_caps(p, latency, small_grid);
  const double e_grid = replay(bytes, p.ready_ns, p.end_ns, grid_pick.first_bytes, grid_pick.bytes, latency.alpha_ns,
                               latency.beta_ns_per_byte, &n);
  ASSERT_LT(e_one, e_grid) << "the test's premise: one bucket beats the small grid on a latency-bound link";
  const BucketCaps kept = choose_caps(p, latency, small_grid, one_bucket);
  EXPECT_EQ(kept.first_bytes, one_bucket.first_bytes) << "better caps in use, off the grid, must be kept";
  EXPECT_EQ(kept.bytes, one_bucket.bytes);
  ASSERT_LT(
      replay(bytes, p.ready_ns, p.end_ns, picks[0].first_bytes, picks[0].bytes, latency.alpha_ns,
             latency.beta_ns_per_byte, &n),
      replay(bytes, p.ready_ns, p.end_ns, tiny.first_bytes, tiny.bytes, latency.alpha_ns, latency.beta_ns_per_byte, &n))
      << "the test's premise: 1 KiB buckets model worse than the grid's pick";
  const BucketCaps left = choose_caps(p, latency, grid, tiny);
  EXPECT_EQ(left.first_bytes, picks[0].first_bytes) << "worse caps in use must give way to the grid's pick";
  EXPECT_EQ(left.bytes, picks[0].bytes);
  // A tie goes to the caps in use: 100 bytes under the pick's caps, off the grid, cut the same buckets (every
  // gradient is a multiple of 512 bytes and every grid cap of 1 KiB).
  const BucketCaps same{picks[0].first_bytes - 100, picks[0].bytes - 100};
  ASSERT_DOUBLE_EQ(
      replay(bytes, p.ready_ns, p.end_ns, same.first_bytes, same.bytes, latency.alpha_ns, latency.beta_ns_per_byte, &n),
      replay(bytes, p.ready_ns, p.end_ns, picks[0].first_bytes, picks[0].bytes, latency.alpha_ns,
             latency.beta_ns_per_byte, &n));
  const BucketCaps tie = choose_caps(p, latency, grid, same);
  EXPECT_EQ(tie.first_bytes, same.first_bytes) << "an equal model must keep the caps in use";
  EXPECT_EQ(tie.bytes, same.bytes);
  EXPECT_THROW(choose_caps(p, latency, grid, BucketCaps{0, 1024}), std::invalid_argument);
}

// BucketedDDP records when each gradient became ready, and set_caps lays the buckets out again at the next forward.
TEST(CapTuning, BucketedDDPProfilesItsBackwardAndTakesNewCaps) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        test_support::GptUnderDdp gpt(comm, 12);
        EXPECT_TRUE(gpt.ddp.last_backward_profile().params.empty()) << "no backward yet";
        EXPECT_THROW(gpt.ddp.set_caps({1 << 20, 1 << 20}), std::logic_error) << "no ready order yet";
        auto step = [&](int s) {
          gpt.opt->zero_grad();
          gpt.ddp.loss(rank_slice(gpt.data->global_batch(s, 8), comm.rank(), 2)).backward();
          gpt.opt->step();
        };
        step(0);
        const BackwardProfile p = gpt.ddp.last_backward_profile();
        ASSERT_EQ(p.params.size(), gpt.ddp.parameters().size());
        for (size_t k = 1; k < p.order.size(); ++k)
          EXPECT_LE(p.ready_ns[p.order[k - 1]], p.ready_ns[p.order[k]]) << "ready times follow the ready order";
        EXPECT_LE(p.ready_ns[p.order.back()], p.end_ns);
        const size_t before = gpt.ddp.buckets().size();
        const std::vector<at::Tensor> grads = test_support::grad_copies(gpt.ddp.parameters());
        gpt.ddp.set_caps({1 << 20, 1 << 20});
        EXPECT_EQ(gpt.ddp.buckets().size(), before) << "nothing changes before the next forward";
        gpt.ddp.loss(rank_slice(gpt.data->global_batch(1, 8), comm.rank(), 2));  // lays the buckets out again
        ASSERT_EQ(gpt.ddp.buckets().size(), 1u);
        for (size_t i = 0; i < grads.size(); ++i)
          EXPECT_TRUE(at::equal(gpt.ddp.parameters()[i].grad(), grads[i]))
              << "gradient " << i << " survives the re-layout";
        if (comm.rank() == 0) EXPECT_EQ(gpt.ddp.buckets()[0].params, p.order) << "laid out in rank 0's ready order";
        step(1);
        EXPECT_EQ(gpt.ddp.buckets().size(), 1u) << "caps of 1 MiB hold the whole tiny GPT";
        EXPECT_EQ(gpt.ddp.caps().first_bytes, 1 << 20);
        if (comm.rank() == 0)
          std::cout << before << " buckets, then 1 after set_caps; ready times span "
                    << (p.ready_ns[p.order.back()] - p.ready_ns[p.order.front()]) / 1e3 << " us\n";
      },
      test_group());
}

// One step of `gpt` on its rank's slice of global batch `s`.
void gpt_step(test_support::GptUnderDdp& gpt, Communicator& comm, int s) {
  gpt.opt->zero_grad();
  gpt.ddp.loss(rank_slice(gpt.data->global_batch(s, 8), comm.rank(), 2)).backward();
  gpt.opt->step();
}

// The smallest and the largest of `v` over the ranks of `comm` (a check that every rank holds the same value).
std::pair<int64_t, int64_t> spread(Communicator& comm, int64_t v) {
  at::Tensor both = at::tensor({-v, v}, at::kLong);  // max(-v) = -min(v)
  comm.all_reduce(both, ReduceOp::kMax).wait();
  return {-both[0].item<int64_t>(), both[1].item<int64_t>()};
}

// AutoCaps, the seam parallelize's auto caps are: nothing at the first step (the buckets are not rebuilt yet), a
// measurement, rank 0's choice and set_caps at the second, nothing after; every rank takes the same caps, and the
// measurement's collectives are the range it reports as setup.
TEST(AutoCaps, TunesOnceAfterTheFirstBackwardOnRebuiltBucketsAndEveryRankTakesRankZerosChoice) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        const BucketCaps start{2 << 10, 4 << 10};
        test_support::GptUnderDdp gpt(comm, 12, start);
        AutoCaps tuner(gpt.ddp, comm);
        gpt_step(gpt, comm, 0);
        size_t records = comm.recorder().size();
        tuner.after_optimizer_step();
        EXPECT_FALSE(tuner.choice()) << "step 1's backward ran on the first layout, not the rebuilt one";
        EXPECT_EQ(comm.recorder().size(), records) << "no collective before it tunes";
        gpt_step(gpt, comm, 1);
        records = comm.recorder().size();
        tuner.after_optimizer_step();
        ASSERT_TRUE(tuner.choice()) << "tuned after step 2";
        const CapChoice& c = *tuner.choice();
        EXPECT_EQ(c.before.first_bytes, start.first_bytes);
        EXPECT_EQ(c.before.bytes, start.bytes);
        EXPECT_EQ(gpt.ddp.caps().first_bytes, c.chosen.first_bytes);
        EXPECT_EQ(gpt.ddp.caps().bytes, c.chosen.bytes);
        EXPECT_TRUE(gpt.ddp.caps_set());
        EXPECT_EQ(c.setup.first, records) << "the setup range starts at the measurement";
        EXPECT_EQ(c.setup.second, comm.recorder().size()) << "and ends after the broadcast of the choice";
        EXPECT_GT(c.setup.second, c.setup.first);
        EXPECT_EQ(c.profile.params.size(), gpt.ddp.parameters().size()) << "chosen from step 2's backward";
        const auto first = spread(comm, c.chosen.first_bytes), later = spread(comm, c.chosen.bytes);
        EXPECT_EQ(first.first, first.second) << "every rank takes rank 0's first cap";
        EXPECT_EQ(later.first, later.second) << "every rank takes rank 0's later cap";
        gpt_step(gpt, comm, 2);
        records = comm.recorder().size();
        tuner.after_optimizer_step();
        EXPECT_EQ(comm.recorder().size(), records) << "it tunes once";
        EXPECT_EQ(tuner.choice()->setup, c.setup);
        if (comm.rank() == 0)
          std::cout << "chose " << c.chosen.first_bytes << " and " << c.chosen.bytes << " bytes (from "
                    << start.first_bytes << " and " << start.bytes << "), " << gpt.ddp.buckets().size()
                    << " buckets; alpha " << c.cost.alpha_ns / 1e3 << " us\n";
      },
      test_group());
}

// A resumed run tunes at the step the uninterrupted one did: not at all when the checkpoint's caps were tuned
// (caps_set travels with the layout), after its first step when the checkpoint was saved after step 1 (its layout
// rebuilt from step 1's ready order, its caps not tuned yet).
TEST(AutoCaps, AResumedRunTunesAtTheStepTheUninterruptedRunDid) {
  test_support::TempDir dir("auto_caps");
  const BucketCaps start{2 << 10, 4 << 10};
  for (int saved_after : {1, 2}) {
    BucketCaps tuned_caps;
    run_ranks(
        2,
        [&](Communicator& comm) {
          test_support::GptUnderDdp gpt(comm, 12, start);
          AutoCaps tuner(gpt.ddp, comm);
          for (int s = 0; s < saved_after; ++s) {
            gpt_step(gpt, comm, s);
            tuner.after_optimizer_step();
          }
          ASSERT_EQ(tuner.choice().has_value(), saved_after == 2);
          if (comm.rank() == 0) tuned_caps = gpt.ddp.caps();  // every rank has the same: one writes
          gpt.ddp.save_checkpoint(dir / "mid", gpt.opt.get());
        },
        test_group());
    run_ranks(
        2,
        [&](Communicator& comm) {
          test_support::GptUnderDdp gpt(comm, 12, {64 << 10, 64 << 10});  // other caps: the checkpoint's win
          AutoCaps tuner(gpt.ddp, comm);
          gpt.ddp.load_checkpoint(dir / "mid", gpt.opt.get());
          EXPECT_EQ(gpt.ddp.caps_set(), saved_after == 2) << "saved after step " << saved_after;
          gpt_step(gpt, comm, saved_after);
          tuner.after_optimizer_step();
          if (saved_after == 2) {
            EXPECT_FALSE(tuner.choice()) << "the checkpoint's caps were tuned already";
            EXPECT_EQ(gpt.ddp.caps().first_bytes, tuned_caps.first_bytes);
            EXPECT_EQ(gpt.ddp.caps().bytes, tuned_caps.bytes);
          } else {
            ASSERT_TRUE(tuner.choice()) << "resumed at step 2, tuned after it, as the uninterrupted run";
            EXPECT_EQ(tuner.choice()->before.first_bytes, start.first_bytes) << "from the checkpoint's caps";
          }
        },
        test_group());
  }
}

}  // namespace
}  // namespace shardlab::bucketed_ddp
