#pragma once
// Clipped training configurations for the wrappers' clipping tests (grad_clip.h): the bound must bind, or an
// equivalence with the clipped single device could not tell clipping from none.
#include "shardlab/course/reference.h"

#include <gtest/gtest.h>

#include <iostream>
#include <limits>

namespace shardlab::test_support {

/// p = infinity, for clip_p.
constexpr double kInfNorm = std::numeric_limits<double>::infinity();

/// `c` with every step's gradient clipped to `bound` in the p-norm; checks (a gtest failure) that the clipped
/// single-device run ends at least 1e-4 away from the unclipped one, so the bound really binds.
inline TrainConfig binding_clip(TrainConfig c, double bound, double p) {
  const ReferenceResult free = train_reference(c);
  c.clip_norm = bound;
  c.clip_p = p;
  const double moved = max_abs_diff(train_reference(c).params, free.params);
  std::cout << "clip to " << bound << " in the " << p << "-norm moves the single-device result by " << moved << "\n";
  EXPECT_GT(moved, 1e-4) << "the bound " << bound << " does not bind: pick a smaller one";
  return c;
}

}  // namespace shardlab::test_support
