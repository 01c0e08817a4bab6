#pragma once
// The process-group options the multi-rank tests share: a collective that hangs fails after 30 s, naming the rank
// and the op, well inside the tests' ctest TIMEOUT.
#include "shardlab/core/comm/process_group.h"

#include <chrono>

namespace shardlab::test_support {

/// Gloo groups with a 30 s collective timeout.
inline GroupOptions test_group() {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(30'000);
  return o;
}

}  // namespace shardlab::test_support
