#pragma once
// The tolerance of the suites that compare N ranks with one device on the union batch (Note [Comparing with one
// device] in common/course/src/reference.cpp): the sums run in another order, nothing else differs.
#include "shardlab/course/reference.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace shardlab::test_support {

/// all_close's rtol and atol for N ranks' parameters against one device's.
inline constexpr double kRtol = 1e-5, kAtol = 1e-6;

/// Checks that every rank's `finals[r]` is all_close to `want` within kRtol and kAtol (a gtest failure per rank that
/// is not), printing each rank's largest difference after `label` (its parts streamed, a space after each: `"p", p`).
template <typename... Label>
void expect_ranks_match(const std::vector<std::vector<at::Tensor>>& finals, const std::vector<at::Tensor>& want,
                        const Label&... label) {
  std::ostringstream parts;
  ((parts << label << " "), ...);
  const std::string who = parts.str();
  for (size_t r = 0; r < finals.size(); ++r) {
    const double diff = max_abs_diff(finals[r], want);
    std::cout << who << "rank " << r << ": max |param - one device| = " << diff << "\n";
    EXPECT_TRUE(all_close(finals[r], want, kRtol, kAtol)) << who << "rank " << r << " differs by " << diff;
  }
}

}  // namespace shardlab::test_support
