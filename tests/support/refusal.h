#pragma once
// A wrapper's construction that every rank must refuse alike (the ranks' models differ: check_same_model), and
// what each rank ran meanwhile.
#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/comm/communicator.h"

#include <gtest/gtest.h>

#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab::test_support {

/// One rank's view of a refused construction.
struct Refusal {
  std::string error;                  ///< the std::invalid_argument's message; empty when none was thrown
  std::vector<CollectiveRecord> ran;  ///< the collectives this rank ran during the construction
};

/// Runs `construct` on this rank, catching std::invalid_argument, and notes the collectives it ran.
inline Refusal refusal_of(Communicator& comm, const std::function<void()>& construct) {
  Refusal r;
  const size_t marker = comm.recorder().size();
  try {
    construct();
  } catch (const std::invalid_argument& e) {
    r.error = e.what();
  }
  r.ran = comm.recorder().since(marker);
  return r;
}

/// Every rank refused with the same message, saying that the models differ and containing every piece of `pieces`,
/// and ran exactly the check's two all-gathers: the digests (4 int64 per rank), then the structures.
inline void expect_same_refusal(const std::vector<Refusal>& seen, const std::vector<std::string>& pieces = {}) {
  std::cout << "rank 0: " << seen.at(0).error << "\n";
  for (size_t r = 0; r < seen.size(); ++r) {
    EXPECT_NE(seen[r].error.find("the ranks' models differ"), std::string::npos)
        << "rank " << r << ": " << seen[r].error;
    for (const auto& piece : pieces)
      EXPECT_NE(seen[r].error.find(piece), std::string::npos)
          << "rank " << r << ": expected \"" << piece << "\" in: " << seen[r].error;
    EXPECT_EQ(seen[r].error, seen[0].error) << "every rank throws the same message";
    ASSERT_EQ(seen[r].ran.size(), 2u) << "rank " << r << ": the check's two all-gathers and nothing else";
    EXPECT_EQ(seen[r].ran[0].op, "all_gather");
    EXPECT_EQ(seen[r].ran[0].numel, 4) << "rank " << r << ": the first is the digests";
    EXPECT_EQ(seen[r].ran[1].op, "all_gather");
  }
}

}  // namespace shardlab::test_support
