// Stage 04, task 1 — the shard layout: FSDP2's torch.chunk rule, padded shards, nothing lost or invented.
#include "shardlab/fsdp/shard_layout.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <vector>

namespace shardlab::fsdp {
namespace {

struct LayoutCase {
  int64_t d0;
  int world;
  std::vector<int64_t> rows;  // real rows per rank, as torch.chunk (plus empty chunks) gives them
};

TEST(ShardLayout, RowsPerRankFollowTorchChunkAndConcatenateToTheOriginal) {
  const std::vector<LayoutCase> cases{
      {5, 4, {2, 2, 1, 0}}, {7, 4, {2, 2, 2, 1}}, {1, 2, {1, 0}}, {8, 4, {2, 2, 2, 2}}, {7, 3, {3, 3, 1}}};
  for (const auto& c : cases) {
    const at::Tensor full = at::arange(c.d0 * 3, at::kFloat).view({c.d0, 3}).mul_(1.25);
    const ShardSpec spec = shard_spec(full.sizes(), c.world);
    const int64_t padded = (c.d0 + c.world - 1) / c.world;
    EXPECT_EQ(spec.padded_rows, padded) << "d0 " << c.d0 << " S " << c.world;
    EXPECT_EQ(spec.row_numel, 3);
    std::vector<at::Tensor> real;
    std::vector<int64_t> rows;
    for (int r = 0; r < c.world; ++r) {
      rows.push_back(spec.rows_of(r));
      at::Tensor shard = at::full({spec.padded_numel()}, -7.0f);  // garbage the copy-in must overwrite
      copy_in_shard(spec, full, r, shard);
      const at::Tensor as_rows = shard.view({padded, 3});
      real.push_back(as_rows.narrow(0, 0, spec.rows_of(r)));
      EXPECT_TRUE(as_rows.narrow(0, spec.rows_of(r), padded - spec.rows_of(r)).eq(0).all().item<bool>())
          << "padding rows of rank " << r << " must be zero";
      EXPECT_EQ(spec.shard_sizes(r), (std::vector<int64_t>{spec.rows_of(r), 3}));
    }
    EXPECT_EQ(rows, c.rows) << "d0 " << c.d0 << " S " << c.world;
    const at::Tensor joined = at::cat(real, 0);
    const bool exact = joined.sizes() == full.sizes() && at::equal(joined, full);
    std::cout << "d0 " << c.d0 << " over " << c.world << " ranks: rows [";
    for (size_t r = 0; r < rows.size(); ++r) std::cout << (r ? ", " : "") << rows[r];
    std::cout << "], padded " << spec.padded_rows << ", concatenation " << (exact ? "bit-exact" : "DIFFERS") << "\n";
    EXPECT_TRUE(exact);
  }
}

TEST(ShardLayout, ScalarsAndBadShapesAreRejectedWithTheirShape) {
  try {
    shard_spec(c10::IntArrayRef{}, 2);
    FAIL() << "a scalar was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("scalar"), std::string::npos) << e.what();
  }
  EXPECT_THROW(shard_spec({4, 2}, 0), std::invalid_argument);
  const ShardSpec spec = shard_spec({4, 2}, 2);
  EXPECT_THROW(copy_in_shard(spec, at::zeros({4, 3}), 0, at::zeros({4})), std::invalid_argument);
  EXPECT_THROW(copy_in_shard(spec, at::zeros({4, 2}), 0, at::zeros({5})), std::invalid_argument);
}

TEST(ShardLayout, OneDimensionalAndWiderTensorsShardOnDimZero) {
  const ShardSpec bias = shard_spec({10}, 4);  // 3, 3, 3, 1
  EXPECT_EQ(bias.padded_rows, 3);
  EXPECT_EQ(bias.row_numel, 1);
  EXPECT_EQ(bias.rows_of(3), 1);
  EXPECT_EQ(bias.first_row_of(3), 9);
  const ShardSpec cube = shard_spec({3, 2, 5}, 4);  // 1, 1, 1, 0
  EXPECT_EQ(cube.row_numel, 10);
  EXPECT_EQ(cube.padded_numel(), 10);
  EXPECT_EQ(cube.rows_of(3), 0);
  EXPECT_EQ(cube.first_row_of(3), 3);
}

// Two promises of the header that FSDP's own paths never exercise (copy-in, copy-out and the reduce-scatter layout
// skip empty chunks, and copy in within one dtype): an empty chunk starts at d0, and copy_in_shard casts.
TEST(ShardLayout, EmptyChunksStartAtTheEndAndCopyInCastsIntoTheShardsDtype) {
  // (d0, S) with ranks past the last chunk, whose rank * padded_rows runs past d0: rows and first rows by hand.
  struct Empty {
    int64_t d0;
    int world;
    std::vector<int64_t> rows, first;
  };
  for (const Empty& c : std::vector<Empty>{{5, 4, {2, 2, 1, 0}, {0, 2, 4, 5}},
                                           {6, 4, {2, 2, 2, 0}, {0, 2, 4, 6}},
                                           {2, 4, {1, 1, 0, 0}, {0, 1, 2, 2}},
                                           {1, 3, {1, 0, 0}, {0, 1, 1}}}) {
    const ShardSpec spec = shard_spec({c.d0, 2}, c.world);
    for (int r = 0; r < c.world; ++r) {
      EXPECT_EQ(spec.rows_of(r), c.rows[r]) << "d0 " << c.d0 << " S " << c.world << " rank " << r
                                            << ": torch.chunk's rows (6 rows over 4 ranks are three chunks of 2 "
                                               "and an empty one, not 2, 2, 1, 1)";
      EXPECT_EQ(spec.first_row_of(r), c.first[r])
          << "d0 " << c.d0 << " S " << c.world << " rank " << r
          << ": the chunks tile [0, d0) in rank order, and an empty chunk starts at d0";
    }
  }
  // Values are cast: double rows into a float shard, float rows (integers) into a long shard.
  const at::Tensor full = at::arange(10, at::kDouble).view({5, 2}).mul_(0.1);
  const ShardSpec spec = shard_spec(full.sizes(), 2);  // rows [3, 2], padded 3
  at::Tensor shard = at::full({spec.padded_numel()}, -7.0f);
  copy_in_shard(spec, full, 1, shard);
  const at::Tensor want = at::cat({full.narrow(0, 3, 2).to(at::kFloat), at::zeros({1, 2})}).view({-1});
  EXPECT_TRUE(at::equal(shard, want)) << "rank 1's rows of a double tensor in a float shard: expected " << want
                                      << ", got " << shard;
  const at::Tensor counts = at::arange(10, at::kFloat).view({5, 2}).mul_(3);
  at::Tensor long_shard = at::full({spec.padded_numel()}, int64_t{-7}, at::kLong);
  copy_in_shard(spec, counts, 0, long_shard);
  EXPECT_TRUE(at::equal(long_shard, counts.narrow(0, 0, 3).to(at::kLong).view({-1})))
      << "rank 0's rows of a float tensor in a long shard: expected " << counts.narrow(0, 0, 3).view({-1}) << ", got "
      << long_shard;
}

}  // namespace
}  // namespace shardlab::fsdp
