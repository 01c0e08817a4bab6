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

/// Checks that every rank's `got[r]` is all_close to `want[r]` within `rtol` and `atol` (a gtest failure per rank that
/// is not), printing each rank's largest difference after `label` (its parts streamed, a space after each: `"p", p`).
template <typename... Label>
void expect_ranks_close(const std::vector<std::vector<at::Tensor>>& got,
                        const std::vector<std::vector<at::Tensor>>& want, double rtol, double atol,
                        const Label&... label) {
  std::ostringstream parts;
  ((parts << label << " "), ...);
  const std::string who = parts.str();
  for (size_t r = 0; r < got.size(); ++r) {
    const double diff = max_abs_diff(got[r], want.at(r));
    std::cout << who << "rank " << r << ": max |param - expected| = " << diff << "\n";
    EXPECT_TRUE(all_close(got[r], want.at(r), rtol, atol)) << who << "rank " << r << " differs by " << diff;
  }
}

/// expect_ranks_close of every rank's `finals[r]` against the one device's `want`, within kRtol and kAtol.
template <typename... Label>
void expect_ranks_match(const std::vector<std::vector<at::Tensor>>& finals, const std::vector<at::Tensor>& want,
                        const Label&... label) {
  expect_ranks_close(finals, std::vector<std::vector<at::Tensor>>(finals.size(), want), kRtol, kAtol, label...);
}

}  // namespace shardlab::test_support
