#pragma once
// The tiny GPT of the memory tests: 8 blocks of width 64 (1.6 MB in fp32), so that a block is an eighth of the
// model, the root (embeddings, final norm) is small, and a bound of a few tensors is far below the model.
#include "shardlab/course/reference.h"

#include "support/train_config.h"

namespace shardlab::test_support {

/// The tiny GPT's config with 8 blocks of width 64 (the other fields at their defaults).
inline TrainConfig eight_block_gpt() { return config("tiny_gpt").layers(8).dim(64); }

}  // namespace shardlab::test_support
