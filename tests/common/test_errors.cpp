// The three error tiers (Note [Three error tiers]): an internal assertion is its own type and names where it
// failed; warn_once prints once per key and counts the rest; the communicator warns once on its slow fallbacks.
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/numbers.h"

#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <type_traits>

namespace shardlab {
namespace {

// Neither is a user check: a test expecting std::logic_error or std::runtime_error cannot pass on them.
static_assert(!std::is_base_of_v<std::logic_error, InternalError> &&
              !std::is_base_of_v<std::runtime_error, InternalError>);
static_assert(!std::is_base_of_v<std::logic_error, NotImplemented> &&
              !std::is_base_of_v<std::runtime_error, NotImplemented>);

int checked_half(int even) {
  SHARDLAB_INTERNAL_ASSERT(even % 2 == 0, "got " + std::to_string(even));
  return even / 2;
}

// The one reader of integers written by others (a checkpoint's metadata, RANK, --resume's step): whole decimal
// text in range, nothing else.
TEST(Errors, ParseIntegerTakesWholeDecimalTextInRangeAndNothingElse) {
  EXPECT_EQ(parse_integer("0", 0, 10), 0);
  EXPECT_EQ(parse_integer("10", 0, 10), 10);
  EXPECT_EQ(parse_integer("-3", -5, 5), -3);
  EXPECT_EQ(parse_integer("4294967295", 0, 0xffffffffLL), 0xffffffffLL);
  EXPECT_EQ(parse_integer("9223372036854775807", 0, INT64_MAX), INT64_MAX);
  for (const char* bad : {"", " 1", "1 ", "+1", "-0", "-1", "11", "1e3", "0x1", "12abc", "1.0", "99999999999999999999"})
    EXPECT_EQ(parse_integer(bad, 0, 10), std::nullopt) << "'" << bad << "' was taken";
}

TEST(Errors, InternalAssertionNamesTheConditionTheFileAndTheDetail) {
  EXPECT_EQ(checked_half(4), 2);
  try {
    checked_half(3);
    ADD_FAILURE() << "a broken invariant passed";
  } catch (const InternalError& e) {
    const std::string what = e.what();
    std::cout << "error: " << what << "\n";
    for (const char* part : {"even % 2 == 0", "test_errors.cpp:", "got 3", "bug in shardlab"})
      EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
  }
}

TEST(Errors, NotImplementedSaysWhichStageAndWhat) {
  const NotImplemented e("04", "shard the parameters");
  EXPECT_STREQ(e.what(), "not implemented: stage 04 \u2014 shard the parameters");
}

TEST(Errors, WarnOncePrintsTheFirstTimeAndCountsEveryTime) {
  const std::string key = "test: warn once";
  testing::internal::CaptureStderr();
  EXPECT_TRUE(warn_once(key, "first"));
  EXPECT_FALSE(warn_once(key, "second"));
  EXPECT_FALSE(warn_once(key, "third"));
  const std::string printed = testing::internal::GetCapturedStderr();
  std::cout << "stderr: " << printed;
  EXPECT_EQ(printed, "shardlab warning: first\n");
  EXPECT_EQ(warn_count(key), 3);
  EXPECT_EQ(warn_count("test: never warned"), 0);
}

TEST(Errors, TheCommunicatorWarnsOnceWhenReduceScatterTravelsAsAnAllReduce) {
  const std::string key = "reduce_scatter sent as all_reduce";
  const int before = warn_count(key);
  run_ranks(
      2,
      [&](Communicator& comm) {
        comm.set_reduce_scatter_algorithm(ReduceScatterAlgorithm::kAllReduce);
        // 1 MiB at 2 ranks: the ring would send half of what the all-reduce sends.
        at::Tensor input = at::ones({2 * 131072}), output = at::empty({131072});
        comm.reduce_scatter(output, input, ReduceOp::kSum).wait();
        comm.reduce_scatter(output, input, ReduceOp::kSum).wait();
        EXPECT_TRUE(at::equal(output, at::full({131072}, 2.0f)));
      },
      test_support::test_group());
  EXPECT_EQ(warn_count(key), before + 4) << "each rank's two reduce-scatters pass the warning";
}

TEST(Errors, TheCommunicatorWarnsWhenBf16TravelsAsF32AndOnlyThen) {
  const std::string key = "bf16 sent as f32";
  const int before = warn_count(key);
  run_ranks(
      2,
      [&](Communicator& comm) {
        at::Tensor f32 = at::ones({8});
        comm.all_reduce(f32, ReduceOp::kSum).wait();
        at::Tensor bf16 = at::ones({8}, at::kBFloat16);
        comm.all_reduce(bf16, ReduceOp::kSum).wait();
        EXPECT_TRUE(at::equal(bf16, at::full({8}, 2.0f, at::kBFloat16)));
      },
      test_support::test_group());
  const int expected = compat::gloo_features().bfloat16 ? 0 : 2;  // one bf16 all-reduce on each rank
  std::cout << "this Gloo " << (compat::gloo_features().bfloat16 ? "has" : "has no") << " bf16; warnings seen "
            << warn_count(key) - before << "\n";
  EXPECT_EQ(warn_count(key) - before, expected);
}

}  // namespace
}  // namespace shardlab
