// Stage 05, given code — a PrefetchPolicy is checked once, against the units it will schedule, and every bad field
// is named with what was expected and what came.
#include "shardlab/prefetch/prefetch_policy.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardlab::prefetch {
namespace {

const std::vector<std::string> kUnits{"block0", "block1", "block2", "root"};

void expect_rejected(const PrefetchPolicy& p, const std::string& fragment) {
  try {
    validate(p, kUnits);
    ADD_FAILURE() << "accepted; expected an error mentioning '" << fragment << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(PrefetchPolicyChecks, NamesTheFieldWhatWasExpectedAndWhatCame) {
  PrefetchPolicy p;
  p.forward_depth = -1;
  expect_rejected(p, "forward_depth: expected 0 or more; got -1");
  p = {};
  p.backward_depth = -2;
  expect_rejected(p, "backward_depth: expected 0 or more; got -2");
  p = {};
  p.max_in_flight = -1;
  expect_rejected(p, "max_in_flight");
  p = {};
  p.forward_lists["block9"] = {"block1"};
  expect_rejected(p, "forward_lists['block9']: expected a unit name (block0, block1, block2, root); got 'block9'");
  p = {};
  p.backward_lists["root"] = {"block2", "blk"};
  expect_rejected(p, "got 'blk'");
  p = {};
  p.backward_lists["block1"] = {"block1"};
  expect_rejected(p, "cannot prefetch itself");
  p = {};
  p.forward_lists["block0"] = {"block1", "block1"};
  expect_rejected(p, "'block1' twice");
  p = {};
  p.max_in_flight = 1;
  p.forward_lists["block0"] = {"block1", "block2"};
  expect_rejected(p, "more than max_in_flight (1)");
  EXPECT_NO_THROW(validate(PrefetchPolicy{}, kUnits));
}

TEST(PrefetchPolicyChecks, TheLimitIsAsDeepAsAskedUnlessSet) {
  PrefetchPolicy p;
  EXPECT_EQ(in_flight_limit(p), 1) << "defaults: depth 1 each way";
  p.forward_depth = 0;
  p.backward_depth = 0;
  EXPECT_EQ(in_flight_limit(p), 1) << "never below 1";
  p.backward_depth = 3;
  EXPECT_EQ(in_flight_limit(p), 3);
  p.forward_lists["block0"] = {"block1", "block2", "root", "block0"};
  EXPECT_EQ(in_flight_limit(p), 4) << "the longest list";
  p.max_in_flight = 2;
  EXPECT_EQ(in_flight_limit(p), 2) << "set: as set";
}

}  // namespace
}  // namespace shardlab::prefetch
