// Stage 02 — a checkpoint of BucketedDDP keeps its bucket layout: a resumed run continues bit for bit. Here, not
// under the label `checkpoint`, so that both tracks run it (the open track's build has stage 02 alone).
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/core/comm/thread_ranks.h"
#include "shardlab/course/model_factory.h"

#include "support/checkpoint_training.h"
#include "support/group.h"
#include "support/temp_dir.h"
#include "support/train_config.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace shardlab {
namespace {

using namespace test_support;  // tests/support: the rank loops, builders and checks

// Bucketed DDP at world size 3 (where the order of a sum changes its rounding): the resumed run lays its buckets
// out as the uninterrupted one had rebuilt them (Note [The bucket layout in a checkpoint]) and continues bit for
// bit.
TEST(Checkpoint, BucketedDdpResumesWithItsRebuiltLayoutBitForBit) {
  TempDir dir("buckets");
  TrainConfig c = test_support::config("tiny_gpt").global_batch(6).seed(11);
  bucketed_ddp::Options options;
  options.caps = {4 << 10, 16 << 10};  // several buckets, so that the layout matters
  auto layout = [](const bucketed_ddp::BucketedDDP& ddp) {
    std::vector<std::vector<size_t>> out;
    for (const auto& b : ddp.buckets()) out.push_back(b.params);
    return out;
  };
  // Saved after step 1 the rebuild is still pending (it runs at the next forward); after step 2 it is done.
  for (int saved_at : {1, 2}) {
    std::vector<at::Tensor> straight, resumed;
    std::vector<std::vector<size_t>> straight_layout, resumed_layout;
    for (int pass = 0; pass < 2; ++pass)
      run_ranks(
          3,
          [&](Communicator& comm) {
            auto model = make_model(c.model, c.seed);
            bucketed_ddp::BucketedDDP ddp(model, comm, options);
            auto opt = make_optimizer("adamw", ddp.parameters(), 0.01);
            if (pass == 0) {
              train(ddp, *opt, comm, c, 0, saved_at);
              ddp.save_checkpoint(dir / "mid", opt.get());
            } else {
              ddp.load_checkpoint(dir / "mid", opt.get());
            }
            train(ddp, *opt, comm, c, saved_at, 4 - saved_at);
            if (comm.rank() != 0) return;
            std::vector<at::Tensor> params;
            for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
            (pass == 0 ? straight : resumed) = params;
            (pass == 0 ? straight_layout : resumed_layout) = layout(ddp);
          },
          test_group());
    EXPECT_EQ(straight_layout, resumed_layout) << "saved at step " << saved_at;
    ASSERT_EQ(straight.size(), resumed.size());
    for (size_t i = 0; i < straight.size(); ++i)
      EXPECT_TRUE(straight[i].equal(resumed[i]))
          << "saved at step " << saved_at << ": parameter " << i << " differs by "
          << (straight[i] - resumed[i]).abs().max().item<double>();
  }
}

}  // namespace
}  // namespace shardlab
