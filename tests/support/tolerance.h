#pragma once
// The tolerance of the suites that compare N ranks with one device on the union batch (Note [Comparing with one
// device] in common/course/src/reference.cpp): the sums run in another order, nothing else differs.

namespace shardlab::test_support {

/// all_close's rtol and atol for N ranks' parameters against one device's.
inline constexpr double kRtol = 1e-5, kAtol = 1e-6;

}  // namespace shardlab::test_support
