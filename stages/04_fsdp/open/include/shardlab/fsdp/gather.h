#pragma once
/// @file gather.h
/// Stage 04 (given) — the extension point of a unit's all-gather, as FSDP2's fsdp_pre_all_gather and
/// fsdp_post_all_gather: what one rank sends, how its padded shards are packed into that, and how each rank's
/// received block is unpacked into padded shards in the param dtype, which the copy-out reads. The default
/// (cast_gather) sends the shards in the param dtype and unpacks nothing. A compressed all-gather (int8 or fp8 with
/// a scale per block) plugs in through Options::gather, or ParallelPolicy::gather, without editing FSDP.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace shardlab::fsdp {

/// What one rank sends in a unit's all-gather: a flat block.
struct GatherWire {
  int64_t numel = 0;                    ///< elements per rank
  c10::ScalarType dtype = c10::kFloat;  ///< their dtype (one the backend can all-gather)
};

/// Makes a flat buffer of `numel` elements of `dtype` on the unit's device (the unit's own: from its pool on CPU).
using BufferMaker = std::function<at::Tensor(int64_t numel, c10::ScalarType dtype)>;

/// How a unit's all-gather packs and unpacks its shards. One object may serve every unit (it keeps no per-unit
/// state); its methods are called on the thread that runs the unit's unshard.
class GatherSeam {
 public:
  virtual ~GatherSeam() = default;
  /// The block one rank sends for a unit whose padded shards are `shard_numel` elements, used in `param_dtype`.
  virtual GatherWire wire(int64_t shard_numel, c10::ScalarType param_dtype) const = 0;
  /// This rank's block (wire()'s numel and dtype) from `shards`, the unit's flat padded shards in their original
  /// dtype. It may return `shards` itself when that already is the block; what it makes comes from `buffer`, and
  /// lives until the all-gather is finished.
  virtual at::Tensor pack(const at::Tensor& shards, c10::ScalarType param_dtype, const BufferMaker& buffer) const = 0;
  /// Rank r's received block (wire()) as `shard_numel` elements of `param_dtype`: the padded shards the copy-out
  /// reads. It may return `block` itself (or a view of it) when that already is; what it makes comes from `buffer`
  /// and lives until the next block is unpacked.
  virtual at::Tensor unpack(const at::Tensor& block, int64_t shard_numel, c10::ScalarType param_dtype,
                            const BufferMaker& buffer) const = 0;
  /// The bytes pack makes (0 when it sends the shards themselves), and unpack for one block (0 when it makes
  /// nothing): what a memory theory adds beside the all-gather's blocks. `orig_dtype` is the shards' dtype.
  virtual int64_t pack_bytes(int64_t shard_numel, c10::ScalarType orig_dtype, c10::ScalarType param_dtype) const = 0;
  virtual int64_t unpack_bytes(int64_t shard_numel, c10::ScalarType param_dtype) const = 0;  ///< see pack_bytes
};

/// The default: each rank sends its padded shards in the param dtype (cast into a new block when that differs from
/// their own; the shards themselves otherwise), and a received block is the padded shards as they are.
std::shared_ptr<const GatherSeam> cast_gather();

}  // namespace shardlab::fsdp
