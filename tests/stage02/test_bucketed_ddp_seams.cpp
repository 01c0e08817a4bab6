// Stage 02 — the guided track's internal seam: agree_on_order (task 2), a helper the open track's student need not
// write (its header is not in the open starter), so this suite is labelled `guided`.
#include "shardlab/bucketed_ddp/order_agreement.h"
#include "shardlab/core/comm/thread_ranks.h"

#include "support/device.h"
#include "support/group.h"
#include "support/watched_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <numeric>
#include <vector>

namespace shardlab::bucketed_ddp {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

// Task 2: every rank leaves with rank 0's order, in one broadcast of one int64 per entry, waited for.
TEST(AgreeOnOrder, EveryRankGetsRankZerosOrderInOneBroadcast) {
  const int world = 3;
  std::vector<Watch> watches(world);
  std::vector<std::vector<size_t>> agreed(world);
  std::vector<std::vector<CollectiveRecord>> recs(world);
  run_ranks(
      world,
      [&](Communicator& comm) {
        std::vector<size_t> mine(5);
        std::iota(mine.begin(), mine.end(), size_t{0});
        std::rotate(mine.begin(), mine.begin() + comm.rank() + 1, mine.end());  // a different order on every rank
        agreed[comm.rank()] = agree_on_order(comm, mine, test_support::device());
        recs[comm.rank()] = comm.recorder().since(0);
      },
      watched_group(watches));
  const std::vector<size_t> rank0{1, 2, 3, 4, 0};
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(agreed[r], rank0) << "rank " << r;
    ASSERT_EQ(recs[r].size(), 1u) << "rank " << r << ": one collective";
    EXPECT_EQ(recs[r][0].op, "broadcast");
    EXPECT_EQ(recs[r][0].numel, 5);
    EXPECT_EQ(recs[r][0].bytes, 5 * 8) << "int64 entries";
    EXPECT_EQ(watches[r].waited_ns.size(), 1u) << "rank " << r << ": the broadcast is waited for before returning";
  }
  std::cout << "every rank got rank 0's order 1 2 3 4 0 in " << recs[1].size() << " broadcast of " << recs[1][0].bytes
            << " bytes\n";
}

}  // namespace
}  // namespace shardlab::bucketed_ddp
