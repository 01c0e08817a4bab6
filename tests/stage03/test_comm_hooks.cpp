// Stage 03 — communication hooks. N ranks (threads, real Gloo): the fp32 all-reduce hook plugged into stage 02's
// BucketedDDP must change nothing (bit for bit); the fp16 / bf16 hooks must compute exactly what their casts say,
// train close to the fp32 single-device reference, and halve the bytes on the wire where the backend can.
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/comm_hooks/comm_hook.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include "support/counting_allocator.h"
#include "support/device.h"
#include "support/group.h"
#include "support/param_name.h"
#include "support/train_config.h"
#include "support/train_replica.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace shardlab::comm_hooks {
namespace {

using bucketed_ddp::BucketedDDP;
using bucketed_ddp::BucketReducer;
using bucketed_ddp::Options;

using test_support::test_group;

c10::ScalarType hook_dtype(const std::string& hook) {
  return hook == "fp16" ? at::kHalf : hook == "bf16" ? at::kBFloat16 : at::kFloat;
}

// Rank r's deterministic test gradient: gradient-like magnitudes (N(0, 1e-2)) from a private generator.
at::Tensor rank_grad(int rank, int64_t numel, uint64_t salt) {
  auto gen = at::detail::createCPUGenerator(1000 * salt + static_cast<uint64_t>(rank));
  return at::normal(0.0, 1e-2, {numel}, gen);
}

// ---------------------------------------------------------------------------------------------------------------
// 1. The pre-divide rule

TEST(PredivideFactor, FollowsTheSeedsRuleForWorldSizes1To16) {
  // Worked by hand from the rule "f = 1; while W % f == 0 && W / f > f: f *= 2" (W / f is a real division).
  // W = 3: f = 1 passes (3 % 1 == 0, 3 > 1) so f = 2; then 3 % 2 != 0 stops: pre 2, post 1.5.
  // W = 6: 1 -> 2 (6 > 1), 2 -> 4 (6 % 2 == 0, 3 > 2), stop (6 % 4 != 0): pre 4, post 1.5.
  // W = 16: 1 -> 2 -> 4 (16 / 2 = 8 > 2), stop (16 / 4 = 4 is not > 4): pre 4, post 4.
  struct Row {
    int world;
    double pre, post;
  };
  const Row table[] = {{1, 1, 1},    {2, 2, 1},    {3, 2, 1.5},  {4, 2, 2},    {5, 2, 2.5},  {6, 4, 1.5},
                       {7, 2, 3.5},  {8, 4, 2},    {9, 2, 4.5},  {10, 4, 2.5}, {11, 2, 5.5}, {12, 4, 3},
                       {13, 2, 6.5}, {14, 4, 3.5}, {15, 2, 7.5}, {16, 4, 4}};
  for (const Row& row : table) {
    const double pre = gradient_predivide_factor(row.world);
    const double post = row.world / pre;
    std::cout << "W=" << row.world << ": pre " << pre << ", post " << post << "\n";
    EXPECT_EQ(pre, row.pre) << "world " << row.world;
    EXPECT_EQ(post, row.post) << "world " << row.world;
    EXPECT_EQ(pre * post, static_cast<double>(row.world)) << "world " << row.world;
  }
  EXPECT_THROW(gradient_predivide_factor(0), std::invalid_argument);
  // Why the fp32 hook can equal a plain average bit for bit at every W (see AllReduceHookBitExact): with pre a
  // power of two, (x / pre) / post rounds the same real number as x / W.
  const at::Tensor x = rank_grad(0, 10'000, 3) * 1e3;
  for (const Row& row : table)
    EXPECT_TRUE(at::equal(x.div(row.pre).div(row.post), x.div(static_cast<double>(row.world))))
        << "world " << row.world;
  // DefaultState takes the same factors from its group.
  for (int world : {1, 3, 4}) {
    run_ranks(
        world,
        [&](Communicator& comm) {
          DefaultState state(comm);
          EXPECT_EQ(state.comm, &comm);
          EXPECT_EQ(state.world_size, world);
          EXPECT_EQ(state.gradient_predivide_factor, table[world - 1].pre) << "world " << world;
          EXPECT_EQ(state.gradient_postdivide_factor, table[world - 1].post) << "world " << world;
        },
        test_group());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Training helpers (the loop is test_support::train_replica, shared with stages 01 and 02)

std::vector<at::Tensor> train_rank(Communicator& comm, const TrainConfig& c, const Options& options) {
  auto model = make_model(c.model, c.seed, device_of(c));
  BucketedDDP ddp(model, comm, options);
  return test_support::train_replica(comm, c, *model, ddp);
}

// Trains on `world` ranks with `hook` ("" = stage 02's own all_reduce(AVG)); returns every rank's parameters.
std::vector<std::vector<at::Tensor>> train_world(int world, const TrainConfig& c, const std::string& hook) {
  std::vector<std::vector<at::Tensor>> finals(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        Options options;
        options.caps = {2048, 8192};  // several buckets
        if (!hook.empty()) options.reducer = as_bucket_reducer(make_hook(hook, comm));
        finals[comm.rank()] = train_rank(comm, c, options);
      },
      test_group());
  return finals;
}

struct TrainCase {
  std::string model, optimizer;
  int world, micro;
};

std::ostream& operator<<(std::ostream& os, const TrainCase& t) {
  return os << t.model << "_" << t.optimizer << "_w" << t.world << "_m" << t.micro;
}

TrainConfig config_for(const TrainCase& t) {
  // The global batch divides by 2, 3, 4 ranks, and then by 2 micro-batches
  TrainConfig c = test_support::equivalence_config(t.model, t.optimizer, t.micro).steps(4).global_batch(24).seed(21);
  return c;
}

// ---------------------------------------------------------------------------------------------------------------
// 2. fp32 all-reduce hook == stage 02, bit for bit

class AllReduceHookBitExact : public ::testing::TestWithParam<TrainCase> {};

// Stage 02 computes sum(g_r) / W; the hook computes sum(g_r / pre) / post with pre * post == W. They agree bit
// for bit at every world size, not only where post is a power of two:
//  - pre is a power of two (the rule only doubles), so g / pre is exact and so is every partial sum of the
//    g / pre: scaling by a power of two commutes with rounding. Gloo adds in the same order in both runs (same
//    bucket sizes, same ranks), so the hook's sum is exactly sum(g_r) / pre.
//  - the post-division is then one correctly rounded division of exactly sum(g_r) / pre by post, whose real value
//    is sum(g_r) / W: the same real number stage 02 rounds once. W = 3 (post 1.5) included.
// The identity breaks only where g / pre underflows into the subnormals (below 1.2e-38 in f32), which gradients
// here never reach; in fp16 (below 6.1e-5) it is a real effect, one reason the low-precision hooks are not exact.
TEST_P(AllReduceHookBitExact, MatchesPlainBucketedDDP) {
  const TrainCase t = GetParam();
  const TrainConfig c = config_for(t);
  const auto plain = train_world(t.world, c, "");
  const auto hooked = train_world(t.world, c, "allreduce");
  for (int r = 0; r < t.world; ++r) {
    const double diff = max_abs_diff(hooked[r], plain[r]);
    std::cout << t << " rank " << r << ": max |hook - stage 02| = " << diff << "\n";
    for (size_t i = 0; i < plain[r].size(); ++i)
      EXPECT_TRUE(at::equal(hooked[r][i], plain[r][i])) << "rank " << r << " parameter " << i << " differs by "
                                                        << (hooked[r][i] - plain[r][i]).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(Stage03, AllReduceHookBitExact,
                         ::testing::Values(TrainCase{"mlp", "adamw", 2, 1}, TrainCase{"mlp", "sgd", 4, 2},
                                           TrainCase{"mlp", "adamw", 3, 1}, TrainCase{"tiny_gpt", "sgd", 2, 1},
                                           TrainCase{"tiny_gpt", "sgd", 3, 2}, TrainCase{"tiny_gpt", "sgd", 4, 1}),
                         test_support::StreamedName());

// ---------------------------------------------------------------------------------------------------------------
// 3a. Low-precision hooks compute exactly what the casts say

// Spacing of `prec` numbers near |x| (one ulp), as double; never below the smallest subnormal step.
at::Tensor ulp_of(const at::Tensor& x, c10::ScalarType prec) {
  const int mantissa = prec == at::kHalf ? 10 : 7;
  const double smallest = prec == at::kHalf ? std::ldexp(1.0, -24) : std::ldexp(1.0, -133);
  at::Tensor a = x.to(at::kDouble).abs().clamp_min(smallest);
  return at::exp2(at::floor(at::log2(a)) - mantissa).clamp_min(smallest);
}

// What a low-precision hook must produce from every rank's gradient: cast each to `prec`, divide by pre in `prec`,
// sum as the backend does (fp16: in fp16, one rounding per addition, rank order; bf16 on a backend without bf16:
// the Communicator sums the bf16 values in f32 and rounds once), divide by post in `prec`, cast back.
at::Tensor expected_low_precision(const std::vector<at::Tensor>& grads, c10::ScalarType prec, double pre, double post,
                                  bool native) {
  at::Tensor sum;
  for (const auto& g : grads) {
    at::Tensor low = g.to(prec);
    if (pre > 1) low.div_(pre);
    if (prec == at::kBFloat16 && !native) low = low.to(at::kFloat);
    sum = sum.defined() ? sum + low : low;
  }
  sum = sum.to(prec);
  if (post > 1) sum.div_(post);
  return sum.to(grads.front().scalar_type());
}

// Bound for sums over more than two ranks, whose order differs from the backend's: each of the W - 1 additions
// of either order rounds by at most half an ulp of the magnitude sum, so |got - expected| <= (W - 1) ulps of
// sum_r |g_r / pre|, divided by post.
at::Tensor order_tolerance(const std::vector<at::Tensor>& grads, c10::ScalarType prec, double pre, double post) {
  at::Tensor mag = at::zeros_like(grads.front(), at::kDouble);
  for (const auto& g : grads) mag += g.to(prec).to(at::kDouble).abs() / pre;
  return ulp_of(mag, prec) * static_cast<double>(grads.size() - 1) / post;
}

// What a hook divides by before and after the sum, and whether its backend sums the hook's dtype natively.
struct HookFactors {
  bool native = true;
  double pre = 1, post = 1;
};

// `hook`'s factors, and whether `comm` reduces `prec` natively.
HookFactors factors_of(const CommHook& hook, Communicator& comm, c10::ScalarType prec) {
  return {comm.reduces_natively(prec), hook.state->gradient_predivide_factor, hook.state->gradient_postdivide_factor};
}

// A reducer that records every bucket it is given (this rank's g_r) and what the hook left in it.
struct Capture {
  std::vector<at::Tensor> inputs, results;
};

BucketReducer capturing(CommHook hook, Capture& cap) {
  BucketReducer inner = as_bucket_reducer(std::move(hook));
  return [inner, &cap](Communicator& comm, const at::Tensor& bucket) {
    cap.inputs.push_back(bucket.clone());
    const size_t k = cap.results.size();
    cap.results.emplace_back();
    return inner(comm, bucket).then([&cap, k, bucket] { cap.results[k] = bucket.clone(); });
  };
}

struct LowCase {
  std::string hook, model;
  int world;
};

std::ostream& operator<<(std::ostream& os, const LowCase& c) {
  return os << c.hook << "_" << c.model << "_w" << c.world;
}

class LowPrecisionExact : public ::testing::TestWithParam<LowCase> {};

// Inside BucketedDDP, on real gradients: world 2 is bit-exact (one addition, the same rounding on both sides);
// world 4 is within the summation-order bound above.
TEST_P(LowPrecisionExact, EveryBucketIsTheCastAverage) {
  const LowCase lc = GetParam();
  const c10::ScalarType prec = hook_dtype(lc.hook);
  TrainConfig c = config_for({lc.model, "sgd", lc.world, 1});
  c.steps = 3;
  HookFactors f;  // rank 0's
  std::vector<Capture> caps(lc.world);
  run_ranks(
      lc.world,
      [&](Communicator& comm) {
        CommHook hook = make_hook(lc.hook, comm);
        if (comm.rank() == 0) f = factors_of(hook, comm, prec);
        Options options;
        options.caps = {2048, 8192};
        options.reducer = capturing(hook, caps[comm.rank()]);
        train_rank(comm, c, options);
      },
      test_group());
  const size_t calls = caps[0].inputs.size();
  ASSERT_GT(calls, 3u);
  double max_diff = 0, max_ulps = 0;
  for (size_t k = 0; k < calls; ++k) {
    std::vector<at::Tensor> grads;
    for (int r = 0; r < lc.world; ++r) {
      ASSERT_EQ(caps[r].inputs.size(), calls) << "rank " << r;
      grads.push_back(caps[r].inputs[k]);
    }
    const at::Tensor expected = expected_low_precision(grads, prec, f.pre, f.post, f.native);
    const at::Tensor tol = order_tolerance(grads, prec, f.pre, f.post);
    for (int r = 0; r < lc.world; ++r) {
      const at::Tensor got = caps[r].results[k];
      ASSERT_TRUE(got.defined());
      ASSERT_EQ(got.scalar_type(), at::kFloat) << "the bucket keeps the parameters' dtype";
      const at::Tensor err = (got.to(at::kDouble) - expected.to(at::kDouble)).abs();
      max_diff = std::max(max_diff, err.max().item<double>());
      max_ulps = std::max(max_ulps, (err / ulp_of(expected, prec)).max().item<double>());
      if (lc.world == 2)
        EXPECT_TRUE(at::equal(got, expected))
            << "bucket call " << k << " rank " << r << ": differs by " << err.max().item<double>();
      else
        EXPECT_TRUE(err.le(tol).all().item<bool>()) << "bucket call " << k << " rank " << r;
    }
  }
  std::cout << lc.hook << " " << lc.model << " world " << lc.world << " (" << (f.native ? "native" : "f32 fallback")
            << "): " << calls << " bucket reductions, max |hook - cast reference| = " << max_diff << " (" << max_ulps
            << " ulp of " << c10::toString(prec) << ")\n";
}

INSTANTIATE_TEST_SUITE_P(Stage03, LowPrecisionExact,
                         ::testing::Values(LowCase{"fp16", "mlp", 2}, LowCase{"bf16", "mlp", 2},
                                           LowCase{"fp16", "tiny_gpt", 2}, LowCase{"bf16", "tiny_gpt", 2},
                                           LowCase{"fp16", "mlp", 4}, LowCase{"bf16", "mlp", 4}),
                         test_support::StreamedName());

// ---------------------------------------------------------------------------------------------------------------
// 3b. Low-precision training stays close to the fp32 single-device reference

class LowPrecisionTraining : public ::testing::TestWithParam<LowCase> {};

// Measured max |param - reference| after 4 SGD steps on a global batch of 24 (libtorch 1.13, Gloo): fp16
// 1.8e-5 to 2.8e-5, bf16 1.3e-4 to 2.0e-4 (bf16 keeps 8 bits of mantissa, fp16 11). The tolerances leave a
// margin of 10x over the largest measured value of each dtype.
TEST_P(LowPrecisionTraining, StaysCloseToTheFp32Reference) {
  const LowCase lc = GetParam();
  const double tolerance = lc.hook == "fp16" ? 3e-4 : 2e-3;
  const TrainConfig c = config_for({lc.model, "sgd", lc.world, 1});
  const ReferenceResult ref = train_reference(c);
  const auto finals = train_world(lc.world, c, lc.hook);
  for (int r = 0; r < lc.world; ++r) {
    const double diff = max_abs_diff(finals[r], ref.params);
    std::cout << lc.hook << " " << lc.model << " world " << lc.world << " rank " << r
              << ": max |param - fp32 reference| = " << diff << " (tolerance " << tolerance << ")\n";
    EXPECT_LE(diff, tolerance) << "rank " << r;
    EXPECT_GT(diff, 0.0) << "a low-precision hook cannot be exact; is the hook used at all?";
    EXPECT_EQ(max_abs_diff(finals[r], finals[0]), 0.0) << "every rank holds the same replica";
  }
}

INSTANTIATE_TEST_SUITE_P(Stage03, LowPrecisionTraining,
                         ::testing::Values(LowCase{"fp16", "mlp", 2}, LowCase{"bf16", "mlp", 2},
                                           LowCase{"fp16", "tiny_gpt", 2}, LowCase{"bf16", "tiny_gpt", 2},
                                           LowCase{"fp16", "mlp", 3}, LowCase{"bf16", "tiny_gpt", 4}),
                         test_support::StreamedName());

// ---------------------------------------------------------------------------------------------------------------
// 4. Bytes on the wire

// One synchronized backward of the tiny GPT with each hook; sums the bytes the CommRecorder saw.
struct StepBytes {
  int64_t bytes = 0, numel = 0;
  size_t collectives = 0;
};

TEST(HookBytes, Fp16HalvesTheBytesAndBf16DependsOnTheBackend) {
  std::map<std::string, StepBytes> seen;
  bool bf16_native = false;
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto data = make_dataset("tiny_gpt", 4);
        for (const std::string name : {"allreduce", "fp16", "bf16"}) {
          auto model = make_model("tiny_gpt", 4);
          Options options;
          options.caps = {2048, 8192};
          options.reducer = as_bucket_reducer(make_hook(name, comm));
          BucketedDDP ddp(model, comm, options);
          at::Tensor loss = ddp.loss(rank_slice(data->global_batch(0, 4), comm.rank(), 2));
          const size_t mark = comm.recorder().size();
          loss.backward();
          StepBytes s;
          const c10::ScalarType prec = hook_dtype(name);
          for (const auto& rec : comm.recorder().since(mark)) {
            EXPECT_EQ(rec.op, "all_reduce") << name;
            EXPECT_EQ(rec.reduce, "sum") << name << ": hooks sum and divide themselves";
            EXPECT_EQ(rec.dtype, prec) << name;
            if (name == "bf16" && !comm.reduces_natively(at::kBFloat16))
              EXPECT_EQ(rec.wire_dtype, at::kFloat) << "bf16 goes as f32 where the backend cannot reduce it";
            else
              EXPECT_EQ(rec.wire_dtype, prec) << name;
            s.bytes += rec.bytes;
            s.numel += rec.numel;
            ++s.collectives;
          }
          EXPECT_EQ(s.collectives, ddp.buckets().size()) << name << ": one collective per bucket";
          if (comm.rank() == 0) {
            seen[name] = s;
            bf16_native = comm.reduces_natively(at::kBFloat16);
          }
        }
      },
      test_group());
  const StepBytes fp32 = seen["allreduce"], fp16 = seen["fp16"], bf16 = seen["bf16"];
  std::cout << "bytes per step (tiny_gpt, " << fp32.numel << " gradient elements in " << fp32.collectives
            << " buckets): fp32 " << fp32.bytes << ", fp16 " << fp16.bytes << ", bf16 " << bf16.bytes << " (bf16 "
            << (bf16_native ? "native" : "sent as f32 by the Gloo fallback") << ")\n";
  EXPECT_EQ(fp32.bytes, 4 * fp32.numel);
  EXPECT_EQ(fp16.numel, fp32.numel);
  EXPECT_EQ(bf16.numel, fp32.numel);
  EXPECT_EQ(2 * fp16.bytes, fp32.bytes) << "Gloo reduces fp16 natively: exactly half";
  if (bf16_native)
    EXPECT_EQ(2 * bf16.bytes, fp32.bytes);
  else
    EXPECT_EQ(bf16.bytes, fp32.bytes) << "no bf16 on this backend: the same bytes as fp32";
}

// ---------------------------------------------------------------------------------------------------------------
// 5. Reduce-scatter form

struct ShardCase {
  std::string hook;
  int world;
};

std::ostream& operator<<(std::ostream& os, const ShardCase& c) { return os << c.hook << "_w" << c.world; }

class ReduceScatterForm : public ::testing::TestWithParam<ShardCase> {};

TEST_P(ReduceScatterForm, OutputIsThisRanksChunkOfTheAverage) {
  const ShardCase sc = GetParam();
  const int64_t shard = 37, numel = shard * sc.world;
  const c10::ScalarType prec = hook_dtype(sc.hook);
  std::vector<at::Tensor> grads;
  for (int r = 0; r < sc.world; ++r) grads.push_back(rank_grad(r, numel, 7));
  std::vector<at::Tensor> outputs(sc.world);
  HookFactors f;  // rank 0's
  run_ranks(
      sc.world,
      [&](Communicator& comm) {
        CommHook hook = make_hook(sc.hook, comm);
        if (comm.rank() == 0) f = factors_of(hook, comm, prec);
        at::Tensor grad = grads[comm.rank()].clone();
        at::Tensor out = at::full({shard}, -1.0f);
        const size_t mark = comm.recorder().size();
        Handle h = hook(grad, out);
        h.wait();
        const auto recs = comm.recorder().since(mark);
        ASSERT_EQ(recs.size(), 1u) << "one collective";
        EXPECT_EQ(recs[0].op, "reduce_scatter");
        EXPECT_EQ(recs[0].reduce, "sum") << sc.hook << ": the hook asks for SUM and divides itself (pre and post); "
                                         << "AVG would divide a third time";
        EXPECT_EQ(recs[0].dtype, prec);
        EXPECT_EQ(recs[0].numel, numel);
        outputs[comm.rank()] = out;
      },
      test_group());
  at::Tensor expected, tol;
  if (prec == at::kFloat) {
    at::Tensor sum = at::zeros({numel}, at::kDouble);
    for (const auto& g : grads) sum += g.to(at::kDouble);
    expected = sum / sc.world;
    tol = expected.abs() * 1e-6 + 1e-8;
  } else {
    expected = expected_low_precision(grads, prec, f.pre, f.post, f.native);
    tol = sc.world == 2 ? at::zeros({numel}, at::kDouble) : order_tolerance(grads, prec, f.pre, f.post);
  }
  double max_diff = 0;
  for (int r = 0; r < sc.world; ++r) {
    ASSERT_EQ(outputs[r].scalar_type(), at::kFloat) << "output keeps its dtype";
    const at::Tensor chunk = expected.view({sc.world, shard})[r];
    const at::Tensor err = (outputs[r].to(at::kDouble) - chunk.to(at::kDouble)).abs();
    max_diff = std::max(max_diff, err.max().item<double>());
    EXPECT_TRUE(err.le(tol.view({sc.world, shard})[r]).all().item<bool>())
        << "rank " << r << " max diff " << err.max().item<double>();
  }
  std::cout << sc.hook << " reduce-scatter form, world " << sc.world << ": max |output - chunk of "
            << (prec == at::kFloat ? "the exact average" : "the cast reference") << "| = " << max_diff << "\n";
}

INSTANTIATE_TEST_SUITE_P(Stage03, ReduceScatterForm,
                         ::testing::Values(ShardCase{"reduce_scatter", 2}, ShardCase{"reduce_scatter", 3},
                                           ShardCase{"reduce_scatter", 4}, ShardCase{"fp16", 2}, ShardCase{"bf16", 2},
                                           ShardCase{"fp16", 4}, ShardCase{"bf16", 3}),
                         test_support::StreamedName());

// The all-reduce form of the low-precision hooks outside DDP, on a double gradient: the result is cast back to
// the gradient's own dtype, whatever it is.
TEST(LowPrecisionHooks, CastBackIntoTheGradientsDtype) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        for (const std::string name : {"fp16", "bf16"}) {
          CommHook hook = make_hook(name, comm);
          at::Tensor grad = at::full({5}, comm.rank() == 0 ? 1.0 : 3.0, at::kDouble);
          hook(grad).wait();
          EXPECT_EQ(grad.scalar_type(), at::kDouble);
          EXPECT_TRUE(at::equal(grad, at::full({5}, 2.0, at::kDouble))) << name << ": " << grad;
        }
      },
      test_group());
}

// ---------------------------------------------------------------------------------------------------------------
// 6. The contract of every hook, on values chosen so that each rule shows in the result

// Why the division is split (Note [Pre- and post-division]): dividing only after the sum overflows where the
// split does not, dividing only before underflows where the split does not. Every rank holds the same value v, so
// the average is v, and the split computes it exactly: (v / pre) * W / post = v.
//  - 2 ranks (pre 2, post 1), v near the top of the range: the sum of the v / pre is v; the sum of the v is 2v,
//    which overflows to inf (fp16 tops out at 65504, f32 and bf16 at 3.4e38).
//  - 4 ranks (pre 2, post 2), v two steps above zero (2^-23 in fp16, 2^-148 in f32, 2^-132 in bf16): v / pre is
//    one step, representable; v / 4 is half a step and rounds to zero.
TEST(PrePostDivision, TheSumStaysInRangeAndSmallGradientsSurvive) {
  struct Case {
    std::string hook;
    bool reduce_scatter;  // the form
  };
  const std::vector<Case> cases{{"allreduce", false}, {"reduce_scatter", true}, {"fp16", false},
                                {"fp16", true},       {"bf16", false},          {"bf16", true}};
  for (const int world : {2, 4}) {
    run_ranks(
        world,
        [&](Communicator& comm) {
          for (const Case& c : cases) {
            const c10::ScalarType prec = hook_dtype(c.hook);
            const double v = world == 2 ? (prec == at::kHalf ? 40000.0 : 3e38)
                                        : std::ldexp(1.0, prec == at::kHalf       ? -23
                                                          : prec == at::kBFloat16 ? -132
                                                                                  : -148);
            const float expected = at::scalar_tensor(v, at::kFloat).to(prec).to(at::kFloat).item<float>();
            CommHook hook = make_hook(c.hook, comm);
            at::Tensor grad = at::full({4 * world}, v, at::kFloat);
            at::Tensor out = c.reduce_scatter ? at::full({4}, -1.0f) : at::Tensor();
            hook(grad, out).wait();
            const at::Tensor result = c.reduce_scatter ? out : grad;
            EXPECT_TRUE(result.eq(expected).all().item<bool>())
                << c.hook << (c.reduce_scatter ? " (reduce-scatter form)" : " (all-reduce form)") << ", " << world
                << " ranks each holding " << v << ": expected the average " << expected << ", got "
                << result.max().item<float>() << "; "
                << (world == 2
                        ? "the sum overflows unless each rank divides by pre (" +
                              std::to_string(hook.state->gradient_predivide_factor) + ") before it"
                        : "v / " + std::to_string(world) + " underflows to zero: divide by pre (" +
                              std::to_string(hook.state->gradient_predivide_factor) + ") before the sum and by post (" +
                              std::to_string(hook.state->gradient_postdivide_factor) + ") after it");
          }
        },
        test_group());
  }
}

// The low-precision hooks divide in their own dtype, before and after the sum. At 3 ranks (pre 2, post 1.5) on
// integer gradients every sum is exact in any order, so the result is the cast formula bit for bit, and a
// post-division done in f32 after the cast back (a different rounding of sum / 1.5) shows.
TEST(LowPrecisionHooks, DivideInTheirOwnDtype) {
  const int world = 3;
  const int64_t shard = 40, numel = world * shard;
  std::vector<at::Tensor> grads;
  for (int r = 0; r < world; ++r) {
    auto gen = at::detail::createCPUGenerator(31 + static_cast<uint64_t>(r));
    grads.push_back(at::randint(-50, 50, {numel}, gen, at::TensorOptions().dtype(at::kLong)).to(at::kFloat));
  }
  for (const std::string name : {"fp16", "bf16"}) {
    const c10::ScalarType prec = hook_dtype(name);
    std::vector<at::Tensor> all_reduced(world), scattered(world);
    bool native = true;
    run_ranks(
        world,
        [&](Communicator& comm) {
          CommHook hook = make_hook(name, comm);
          if (comm.rank() == 0) native = comm.reduces_natively(prec);
          at::Tensor grad = grads[comm.rank()].clone();
          hook(grad).wait();
          all_reduced[comm.rank()] = grad;
          at::Tensor out = at::empty({shard});
          hook(grads[comm.rank()].clone(), out).wait();
          scattered[comm.rank()] = out;
        },
        test_group());
    const at::Tensor expected = expected_low_precision(grads, prec, 2, 1.5, native);
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(all_reduced[r], expected))
          << name << " all-reduce form, rank " << r << ": expected (sum of the " << c10::toString(prec)
          << " g / 2) / 1.5, each division in " << c10::toString(prec) << "; differs by "
          << (all_reduced[r] - expected).abs().max().item<double>();
      const at::Tensor chunk = expected.view({world, shard})[r];
      EXPECT_TRUE(at::equal(scattered[r], chunk))
          << name << " reduce-scatter form, rank " << r << ": expected chunk " << r << " of (sum of the "
          << c10::toString(prec) << " g / 2) / 1.5, each division in " << c10::toString(prec) << "; differs by "
          << (scattered[r] - chunk).abs().max().item<double>();
    }
  }
}

// A hook starts the collective and returns: rank 0 calls it while the other ranks wait for it to return (30 s at
// most) before they call theirs, so its collective cannot have completed yet. What needs the result (the
// post-division, the cast back, the copy into output) runs only in wait(): until then `output` is untouched, an
// fp32 all-reduce's grad holds the pre-divided gradient only, and a low-precision hook's grad is untouched (it
// communicates a copy). Rank 0 looks at them before it lets the others call theirs: once they have, the collective
// may complete at any moment and write its sum into grad (a run under load once saw 6, the sum, here). Integer
// gradients: every average is exact.
TEST(HookContract, HooksReturnAtOnceAndFinishOnlyInWait) {
  struct Case {
    std::string hook;
    bool reduce_scatter;
  };
  const std::vector<Case> cases{{"allreduce", false}, {"reduce_scatter", true}, {"fp16", false},
                                {"fp16", true},       {"bf16", false},          {"bf16", true}};
  const int world = 3;  // pre 2, post 1.5
  const int64_t shard = 8;
  std::array<std::atomic<bool>, 6> returned{};
  run_ranks(
      world,
      [&](Communicator& comm) {
        for (size_t i = 0; i < cases.size(); ++i) {
          const Case& c = cases[i];
          const std::string what = c.hook + (c.reduce_scatter ? " (reduce-scatter form)" : " (all-reduce form)");
          CommHook hook = make_hook(c.hook, comm);
          const at::Tensor g = at::full({world * shard}, 2.0f * (comm.rank() + 1));  // average 4
          at::Tensor grad = g.clone();
          at::Tensor out = c.reduce_scatter ? at::full({shard}, -1.0f) : at::Tensor();
          Handle h;
          if (comm.rank() == 0) {
            h = hook(grad, out);
            if (c.reduce_scatter)
              EXPECT_TRUE(out.eq(-1.0f).all().item<bool>())
                  << what << ": output changed before wait() (it holds " << out[0].item<float>()
                  << "); the result goes into output in the handle's continuation";
            else if (c.hook == "allreduce")
              EXPECT_TRUE(grad.eq(2.0f / 2).all().item<bool>())
                  << what << ": before wait() grad must hold the pre-divided gradient (1); it holds "
                  << grad[0].item<float>() << ": the post-division belongs in the handle's continuation";
            else
              EXPECT_TRUE(grad.eq(2.0f).all().item<bool>())
                  << what << ": grad changed before wait() (it holds " << grad[0].item<float>()
                  << "); the hook communicates a low-precision copy and casts back in the continuation";
            returned[i] = true;  // only now may the others call theirs, and the collective complete
          } else {
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
            while (!returned[i] && std::chrono::steady_clock::now() < deadline)
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            EXPECT_TRUE(returned[i]) << what << ": rank 0's hook call had not returned 30 s later, while rank "
                                     << comm.rank()
                                     << " had not called its own: a hook must not wait for its collective";
            h = hook(grad, out);
          }
          h.wait();
          const at::Tensor result = c.reduce_scatter ? out : grad;
          EXPECT_TRUE(result.eq(4.0f).all().item<bool>()) << what << " rank " << comm.rank() << ": " << result;
        }
      },
      test_group());
}

// "A factor of 1 costs nothing": at 1 rank (pre = post = 1) and 2 ranks (post = 1) the fp32 hooks make no pass
// over grad or output beyond what the Communicator's own collective makes. Each in-place pass moves a tensor's
// version counter by one: the hook's count must be the collective's own plus one per factor above 1.
TEST(HookContract, AFactorOfOneCostsNoPassOverTheData) {
  for (const int world : {1, 2}) {
    run_ranks(
        world,
        [&](Communicator& comm) {
          DefaultState state(comm);
          const int pre = state.gradient_predivide_factor > 1 ? 1 : 0;
          const int post = state.gradient_postdivide_factor > 1 ? 1 : 0;
          auto bumps = [](const at::Tensor& t, int64_t before) { return t.defined() ? t._version() - before : 0; };
          // The collective alone.
          at::Tensor g = at::ones({4 * world}), o = at::empty({4});
          int64_t gv = g._version(), ov = o._version();
          comm.all_reduce(g, ReduceOp::kSum).wait();
          const int64_t ar_grad = bumps(g, gv);
          gv = g._version();
          comm.reduce_scatter(o, g, ReduceOp::kSum).wait();
          const int64_t rs_grad = bumps(g, gv), rs_out = bumps(o, ov);
          // The hooks.
          g = at::ones({4 * world});
          gv = g._version();
          allreduce_hook(state, g, at::Tensor()).wait();
          EXPECT_EQ(bumps(g, gv), ar_grad + pre + post)
              << "allreduce_hook at " << world << " ranks (pre " << state.gradient_predivide_factor << ", post "
              << state.gradient_postdivide_factor << "): passes over grad beyond the all-reduce's own " << ar_grad
              << "; a factor of 1 must be skipped";
          g = at::ones({4 * world});
          o = at::empty({4});
          gv = g._version();
          ov = o._version();
          reduce_scatter_hook(state, g, o).wait();
          EXPECT_EQ(bumps(g, gv), rs_grad + pre)
              << "reduce_scatter_hook at " << world << " ranks (pre " << state.gradient_predivide_factor
              << "): passes over grad; a factor of 1 must be skipped";
          EXPECT_EQ(bumps(o, ov), rs_out + post)
              << "reduce_scatter_hook at " << world << " ranks (post " << state.gradient_postdivide_factor
              << "): passes over output; a factor of 1 must be skipped";
        },
        test_group());
  }
}

// What the reduce-scatter form holds beyond its grad and output is what reduce_scatter_scratch_bytes states (FSDP's
// memory meter adds it), measured with a counting CPU allocator. One rank: nothing else allocates meanwhile, so the
// rise must equal the statement to the byte. A gradient already in the hook's dtype needs no cast, but the reduced
// chunk in that dtype is still made.
TEST(HookScratch, TheReduceScatterFormAllocatesExactlyWhatItStates) {
  static auto* counting = new test_support::CountingCpuAllocator();  // outlives every block it counted
  constexpr int64_t kNumel = 4096;
  for (const std::string name : {"reduce_scatter", "fp16", "bf16"}) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      test_support::CountingCpuAllocator::Install install(*counting);
      run_ranks(
          1,
          [&](Communicator& comm) {
            CommHook hook = make_hook(name, comm);
            at::Tensor grad = at::ones({kNumel}, at::TensorOptions().dtype(dtype));
            at::Tensor output = at::empty({kNumel}, grad.options());
            const int64_t stated = reduce_scatter_scratch_bytes(hook, dtype, kNumel, grad.device());
            counting->reset_peak();
            const int64_t before = counting->live();
            hook(grad, output).wait();
            const int64_t rise = counting->peak() - before;
            std::cout << name << " on " << c10::toString(dtype) << ": stated " << stated << " bytes, allocated " << rise
                      << "\n";
            EXPECT_EQ(rise, stated) << name << " on " << c10::toString(dtype);
            EXPECT_TRUE(output.eq(1).all().item<bool>()) << "one rank: the sum is the gradient";
          },
          test_group());
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// 7. Misuse

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  const std::string msg = error_of(fn);
  std::cout << "  error: " << msg << "\n";
  ASSERT_FALSE(msg.empty()) << "expected std::invalid_argument";
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

TEST(Misuse, ErrorsSayWhatWasExpectedAndWhatCame) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        const bool print = comm.rank() == 0;
        auto quiet = [&](const std::function<void()>& fn, const std::vector<std::string>& fragments) {
          if (print) {
            expect_error(fn, fragments);
          } else {
            const std::string msg = error_of(fn);
            EXPECT_FALSE(msg.empty());
          }
        };
        DefaultState state(comm);
        const at::Tensor grad = at::ones({10});
        const size_t mark = comm.recorder().size();
        quiet([&] { allreduce_hook(state, grad, at::zeros({5})); },
              {"allreduce_hook", "expected no output", "5 elements", "reduce_scatter_hook"});
        quiet([&] { reduce_scatter_hook(state, grad, at::Tensor()); },
              {"reduce_scatter_hook", "expected an output", "10 / 2", "got no output"});
        quiet(
            [&] { reduce_scatter_hook(state, grad, at::zeros({4})); },
            {"expected an output of grad.numel() / world_size = 10 / 2 = 5 elements", "got output Float tensor of 4"});
        quiet([&] { fp16_compress_hook(state, at::ones({9}), at::zeros({4})); },
              {"fp16_compress_hook", "2 * 4 = 8", "9 elements", "not a multiple"});
        quiet([&] { reduce_scatter_hook(state, grad, at::zeros({5}, at::kDouble)); }, {"grad's dtype", "Double"});
        quiet([&] { bf16_compress_hook(state, at::ones({4}, at::kLong), at::Tensor()); }, {"floating-point", "Long"});
        quiet([&] { allreduce_hook(state, at::ones({4, 4}).t(), at::Tensor()); }, {"contiguous"});
        quiet([&] { allreduce_hook(state, at::Tensor(), at::Tensor()); }, {"undefined"});
        quiet([&] { make_hook("fp8", comm); }, {"'fp8'", "allreduce, reduce_scatter, fp16, bf16"});
        quiet([&] { as_bucket_reducer(make_hook("reduce_scatter", comm)); }, {"reduce_scatter", "use allreduce"});
        quiet([&] { CommHook{"broken", nullptr, &allreduce_hook}(grad); }, {"broken", "no state"});
        EXPECT_EQ(comm.recorder().size(), mark) << "a rejected call submits nothing";
        // ...and the hooks still work afterwards: each rank contributes rank + 1, the average is 1.5.
        for (const std::string name : {"allreduce", "fp16", "bf16"}) {
          at::Tensor g = at::full({6}, comm.rank() + 1.0f);
          make_hook(name, comm)(g).wait();
          EXPECT_TRUE(at::equal(g, at::full({6}, 1.5f))) << name << ": " << g;
        }
      },
      test_group());
}

}  // namespace
}  // namespace shardlab::comm_hooks
