#pragma once
// What the files of stage 02's suite share: caps that cut the mlp into a chosen number of buckets, and one rank's
// tiny GPT under BucketedDDP with its data and optimizer.
#include "shardlab/bucketed_ddp/bucket_plan.h"
#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/course/data.h"
#include "shardlab/course/reference.h"

#include <memory>

namespace shardlab::test_support {

/// Caps that cut the mlp into `buckets` (1, 2 or 3) buckets. Its trainable parameters in reverse registration order
/// (bytes): fc2.bias 16, fc2.weight 1024, fc1.bias 256, fc1.weight 16384, fc0.bias 256, fc0.weight 4096.
inline bucketed_ddp::BucketCaps mlp_caps(int buckets) {
  if (buckets == 1) return {};               // 1 MiB first bucket holds everything
  if (buckets == 2) return {1000, 1 << 20};  // [fc2.*] [the rest]
  return {1000, 16000};                      // [fc2.*] [fc1.*] [fc0.*]
}

/// BucketedDDP's options with `caps`, the others at their defaults.
inline bucketed_ddp::Options with_caps(const bucketed_ddp::BucketCaps& caps) {
  bucketed_ddp::Options options;
  options.caps = caps;
  return options;
}

/// Caps that cut the tiny GPT into several buckets.
inline bucketed_ddp::BucketCaps gpt_caps() { return {2048, 8192}; }

/// One rank's tiny GPT of seed `seed` (on CPU) under BucketedDDP with caps `caps`, the dataset of that seed, and SGD
/// at lr 0.05 over the model's trainable parameters.
struct GptUnderDdp {
  GptUnderDdp(Communicator& comm, uint64_t seed, const bucketed_ddp::BucketCaps& caps = gpt_caps())
      : model(make_model("tiny_gpt", seed)),
        ddp(model, comm, with_caps(caps)),
        data(make_dataset("tiny_gpt", seed)),
        opt(make_optimizer("sgd", trainable_parameters(*model), 0.05)) {}

  std::shared_ptr<Model> model;
  bucketed_ddp::BucketedDDP ddp;
  std::unique_ptr<Dataset> data;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

}  // namespace shardlab::test_support
