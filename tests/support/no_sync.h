#pragma once
// The no_sync contract the replicating DDP wrappers share (stage 01's NaiveDDP, stage 02's BucketedDDP; both hand
// out stage 01's NoSync): one test body, run by each stage's suite on its own wrapper.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"
#include "support/gradients.h"
#include "support/group.h"

#include <gtest/gtest.h>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace shardlab::test_support {

/// On 2 ranks, model `model_name` wrapped by `make(model, comm)` (which returns a std::unique_ptr to the wrapper and
/// may check the wrapper itself): a backward inside `no_sync()` runs no collective and leaves each rank exactly its
/// own gradient (they differ across ranks); scopes nest, each restoring the setting it found; the next backward
/// outside the scope averages the accumulated gradients, exactly (2 ranks: see mean_of_two).
template <typename Make>
void expect_no_sync_contract(const std::string& model_name, Make make) {
  // [rank][parameter]: the ranks' own gradients of the two batches, and .grad() after each backward
  std::vector<std::vector<at::Tensor>> own_first(2), own_second(2), after_no_sync(2), after_sync(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = make_model(model_name, 9);
        auto ddp = make(model, comm);
        const auto params = trainable_parameters(*model);
        auto data = make_dataset(model_name, 9);
        const Batch first = rank_slice(data->global_batch(0, 8), comm.rank(), 2);
        const Batch second = rank_slice(data->global_batch(2, 8), comm.rank(), 2);
        own_first[comm.rank()] = local_gradients(*model, first, params);
        own_second[comm.rank()] = local_gradients(*model, second, params);
        const size_t mark = comm.recorder().size();
        {
          auto scope = ddp->no_sync();
          EXPECT_FALSE(ddp->sync_enabled());
          { auto inner = ddp->no_sync(); }
          EXPECT_FALSE(ddp->sync_enabled()) << "an inner scope restores the setting it found: still off";
          ddp->loss(first).backward();
        }
        EXPECT_TRUE(ddp->sync_enabled());
        EXPECT_EQ(comm.recorder().size(), mark) << "no collective inside no_sync";
        for (const auto& p : params) after_no_sync[comm.rank()].push_back(p.grad().clone());
        ddp->loss(second).backward();
        EXPECT_GT(comm.recorder().size(), mark) << "the backward after the scope synchronizes";
        for (const auto& p : params) after_sync[comm.rank()].push_back(p.grad().clone());
      },
      test_group());
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(after_no_sync[r].size(), own_first[r].size());
    for (size_t i = 0; i < own_first[r].size(); ++i)
      EXPECT_TRUE(at::equal(after_no_sync[r][i], own_first[r][i]))
          << "rank " << r << " parameter " << i << ": inside no_sync .grad() differs from the rank's own gradient by "
          << max_diff(after_no_sync[r][i], own_first[r][i]);
  }
  const double across = max_abs_diff(after_no_sync[0], after_no_sync[1]);
  std::cout << "gradients after no_sync differ across ranks by up to " << across << "\n";
  EXPECT_GT(across, 0.0);
  for (size_t i = 0; i < own_first[0].size(); ++i) {
    const at::Tensor want = mean_of_two(own_first[0][i] + own_second[0][i], own_first[1][i] + own_second[1][i]);
    for (int r = 0; r < 2; ++r)
      EXPECT_TRUE(at::equal(after_sync[r][i], want))
          << "rank " << r << " parameter " << i << ": after the synchronized backward .grad() differs from the "
          << "average of the accumulated gradients by " << max_diff(after_sync[r][i], want);
  }
}

}  // namespace shardlab::test_support
