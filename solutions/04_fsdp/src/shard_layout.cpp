#include "shardlab/fsdp/shard_layout.h"

#include "shardlab/core/errors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace shardlab::fsdp {

ShardSpec shard_spec(c10::IntArrayRef sizes, int world) {
  if (world < 1) throw std::invalid_argument("shard_spec: expected world >= 1; got " + std::to_string(world));
  if (sizes.empty())
    throw std::invalid_argument(
        "shard_spec: a scalar (0-d) parameter has no dim 0 to shard on; expected at least "
        "one dimension");
  for (int64_t s : sizes)
    if (s < 0) throw std::invalid_argument("shard_spec: negative size in " + c10::str(sizes));
  ShardSpec spec;
  spec.sizes.assign(sizes.begin(), sizes.end());
  spec.world = world;
  // BEGIN SOLUTION(04): padded rows per rank (torch.chunk's chunk size) and elements per row
  spec.padded_rows = (sizes[0] + world - 1) / world;
  for (size_t d = 1; d < sizes.size(); ++d) spec.row_numel *= sizes[d];
  // END SOLUTION
  return spec;
}

int64_t ShardSpec::first_row_of(int rank) const {
  // BEGIN SOLUTION(04): the first row of rank's chunk, clamped to d0 (empty chunks start at the end)
  return std::min(rows(), static_cast<int64_t>(rank) * padded_rows);
  // END SOLUTION
}

int64_t ShardSpec::rows_of(int rank) const {
  // BEGIN SOLUTION(04): real rows of rank's chunk (the sheet's torch.chunk table)
  return std::clamp<int64_t>(rows() - static_cast<int64_t>(rank) * padded_rows, 0, padded_rows);
  // END SOLUTION
}

std::vector<int64_t> ShardSpec::shard_sizes(int rank) const {
  std::vector<int64_t> out = sizes;
  out[0] = rows_of(rank);
  return out;
}

void copy_in_shard(const ShardSpec& spec, const at::Tensor& full, int rank, const at::Tensor& padded) {
  if (full.sizes() != c10::IntArrayRef(spec.sizes))
    throw std::invalid_argument("copy_in_shard: expected a full tensor of sizes " +
                                c10::str(c10::IntArrayRef(spec.sizes)) + "; got " + c10::str(full.sizes()));
  if (padded.numel() != spec.padded_numel() || !padded.is_contiguous())
    throw std::invalid_argument("copy_in_shard: expected a contiguous padded shard of " +
                                std::to_string(spec.padded_numel()) + " elements; got " +
                                std::to_string(padded.numel()));
  // BEGIN SOLUTION(04): the rank's real rows first, zeros after
  const int64_t real = spec.rows_of(rank) * spec.row_numel;
  at::Tensor flat = padded.view({-1});
  if (real > 0)
    flat.narrow(0, 0, real)
        .copy_(full.contiguous().view({-1}).narrow(0, spec.first_row_of(rank) * spec.row_numel, real));
  flat.narrow(0, real, flat.numel() - real).zero_();
  // END SOLUTION
}

}  // namespace shardlab::fsdp
