#pragma once
/// @file shard_layout.h
/// Stage 04, part 1 — how one parameter is split over the ranks of a shard group (PyTorch FSDP2's rule).
///
/// Vocabulary:
///  - *dim 0*: a parameter is cut into row blocks along its first dimension; a *row* is everything below one
///    index of dim 0 (`row_numel` elements).
///  - *chunk*: the rows one rank owns, as `torch.chunk(param, S, dim=0)` would give them, with empty chunks
///    appended until there are S: every chunk but the last non-empty one has ceil(d0 / S) rows, later ranks may
///    have none. d0 = 5, S = 4 gives rows [2, 2, 1, 0]; d0 = 7, S = 3 gives [3, 3, 1].
///  - *padded shard*: every rank stores ceil(d0 / S) rows (`padded_rows`), its chunk first and zeros after, so
///    every rank's shard has the same size and an all-gather of the padded shards is one flat collective. The
///    padding is never part of a parameter, a gradient or an optimizer state.
///
/// References: PyTorch FSDP2 `_fsdp_param.py` (`_chunk_with_empty`, "0th always padded"), DTensor
/// `Shard.local_shard_size_and_offset` ("compute the chunk size inline with torch.chunk").

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

namespace shardlab::fsdp {

/// The shard layout of one parameter of shape `sizes` over `world` ranks.
struct ShardSpec {
  std::vector<int64_t> sizes;  ///< the full (unsharded) parameter's sizes; at least one dimension
  int world = 1;               ///< S, the ranks it is sharded over
  int64_t padded_rows = 0;     ///< ceil(d0 / S): rows every rank stores, its real rows first
  int64_t row_numel = 1;       ///< elements of one row: the product of sizes[1:]

  /// d0, rows of the full parameter.
  int64_t rows() const { return sizes.front(); }
  /// Elements of the full parameter.
  int64_t numel() const { return rows() * row_numel; }
  /// Real (unpadded) rows rank `rank` owns: its torch.chunk chunk; 0 for ranks past the last chunk.
  /// @pre 0 <= rank < world.
  int64_t rows_of(int rank) const;
  /// First row of the full parameter that rank `rank` owns, where its chunk starts (d0 for an empty chunk).
  int64_t first_row_of(int rank) const;
  /// Elements of every rank's padded shard: padded_rows * row_numel.
  int64_t padded_numel() const { return padded_rows * row_numel; }
  /// Sizes of rank `rank`'s real shard: sizes with dim 0 replaced by rows_of(rank).
  std::vector<int64_t> shard_sizes(int rank) const;
};

/// The layout of a parameter of shape `sizes` over `world` ranks.
/// @throws std::invalid_argument for a scalar (no dim 0 to shard on), a negative size, or world < 1.
ShardSpec shard_spec(c10::IntArrayRef sizes, int world);

/// Copies rank `rank`'s real rows of `full` (a tensor of spec.sizes) into `padded` (spec.padded_numel() elements,
/// contiguous, any floating or integer dtype: values are cast) and zeroes the padding rows after them.
/// @throws std::invalid_argument when the shapes do not match the spec.
void copy_in_shard(const ShardSpec& spec, const at::Tensor& full, int rank, const at::Tensor& padded);

}  // namespace shardlab::fsdp
