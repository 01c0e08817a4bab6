#pragma once
// What the checkpoint suite's files share: the MLP they train and save, its training loop over any wrapper, and the
// check that naive DDP loads a sharded checkpoint bit for bit.
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/core/compat.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"
#include "shardlab/naive_ddp/naive_ddp.h"

#include "support/group.h"
#include "support/train_config.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace shardlab::test_support {

/// The MLP the checkpoint tests save: global batch 12, seed 3, the other fields at their defaults.
inline TrainConfig mlp_config() { return config("mlp").global_batch(12).seed(3); }

/// `steps` steps of `wrapper` (any wrapper with loss()) with `opt`, from step `first`, on this rank's slice of each
/// global batch of `c`.
template <typename Wrapper>
void train(Wrapper& wrapper, torch::optim::Optimizer& opt, Communicator& comm, const TrainConfig& c, int first,
           int steps) {
  auto data = make_dataset(c.model, c.seed);
  for (int step = first; step < first + steps; ++step) {
    compat::zero_grad(opt);
    wrapper.loss(rank_slice(data->global_batch(step, c.global_batch), comm.rank(), comm.size())).backward();
    opt.step();
  }
}

/// On `world` thread ranks, NaiveDDP over `c`'s model of another seed (c.seed + 5), with AdamW, loads the checkpoint
/// at `path`; checks that every rank's parameters are then `want`, bit for bit (`label` leads each message).
inline void expect_naive_ddp_loads(const std::string& path, const TrainConfig& c, int world,
                                   const std::vector<at::Tensor>& want, const std::string& label) {
  run_ranks(
      world,
      [&](Communicator& comm) {
        auto model = make_model(c.model, c.seed + 5);
        naive_ddp::NaiveDDP ddp(model, comm);
        auto opt = make_optimizer("adamw", trainable_parameters(*model), 0.01);
        ddp.load_checkpoint(path, opt.get());
        const auto params = model->parameters();
        ASSERT_EQ(params.size(), want.size());
        for (size_t i = 0; i < params.size(); ++i)
          EXPECT_TRUE(params[i].equal(want[i])) << label << ", rank " << comm.rank() << ": parameter " << i
                                                << " differs by " << (params[i] - want[i]).abs().max().item<double>();
      },
      test_group());
}

}  // namespace shardlab::test_support
