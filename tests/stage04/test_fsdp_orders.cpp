// Stage 04 — the expected forward order (FullyShardedModel::expected_forward_order, given): the one rule both the
// memory theory and stage 05's prefetch walk. (Given code, tested where it meets the stage's task: constructing FSDP
// and running a forward fail on the starter, so the test does.)
#include "shardlab/fsdp/fsdp.h"

#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/data.h"

#include "support/chain.h"
#include "support/group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace shardlab::fsdp {
namespace {

using test_support::joined;
using test_support::names_of;

// A chain whose blocks are registered 0-3 and run as 2, 0, 3, 1, all inside the root: before any forward the order
// is registration order with the root first (its forward is the whole loss); after one, the order it ran in.
TEST(FsdpOrders, ExpectedForwardOrderIsRegistrationRootFirstThenTheLastForwards) {
  run_ranks(
      2,
      [&](Communicator& comm) {
        FullyShardedModel fsdp(std::make_shared<test_support::Chain>(std::vector<size_t>{2, 0, 3, 1}), comm);
        const size_t root = fsdp.root_index();
        ASSERT_EQ(root, 4u);
        const std::vector<size_t> before{root, 0, 1, 2, 3};
        EXPECT_EQ(fsdp.expected_forward_order(), before)
            << "before any forward: registration order, root first (" << joined(names_of(fsdp, before)) << "); got "
            << joined(names_of(fsdp, fsdp.expected_forward_order()));
        fsdp.loss(test_support::chain_batch(0, comm)).backward();
        const std::vector<size_t> after{root, 2, 0, 3, 1};
        EXPECT_EQ(fsdp.expected_forward_order(), after)
            << "after a forward: the order it ran in (" << joined(names_of(fsdp, after)) << "); got "
            << joined(names_of(fsdp, fsdp.expected_forward_order()));
      },
      test_support::test_group());
}

}  // namespace
}  // namespace shardlab::fsdp
