#pragma once
// Rank 0 calls first, the other ranks only once its call has returned: how a test proves that a call issuing a
// collective returns without waiting for it (the collective cannot complete before every rank has issued it).
#include "shardlab/core/comm/communicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace shardlab::test_support {

/// Rank 0 runs `call` and then sets `returned` (shared by the ranks, false before); every other rank waits for it,
/// 30 s at most, checks that it came (a gtest failure with `failure` if not), then runs its own `call`. A call that
/// waits for its collective makes the others give up after 30 s instead of hanging.
template <typename Call>
void rank_zero_first(Communicator& comm, std::atomic<bool>& returned, const std::string& failure, Call call) {
  if (comm.rank() == 0) {
    call();
    returned = true;
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!returned && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(returned) << failure;
  call();
}

}  // namespace shardlab::test_support
