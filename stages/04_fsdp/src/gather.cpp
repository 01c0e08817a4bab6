#include "shardlab/fsdp/gather.h"

#include <ATen/ATen.h>

namespace shardlab::fsdp {
namespace {

class CastGather final : public GatherSeam {
 public:
  GatherWire wire(int64_t shard_numel, c10::ScalarType param_dtype) const override {
    return {shard_numel, param_dtype};
  }
  at::Tensor pack(const at::Tensor& shards, c10::ScalarType param_dtype, const BufferMaker& buffer) const override {
    if (shards.scalar_type() == param_dtype) return shards;
    return buffer(shards.numel(), param_dtype).copy_(shards);
  }
  at::Tensor unpack(const at::Tensor& block, int64_t, c10::ScalarType, const BufferMaker&) const override {
    return block;
  }
  int64_t pack_bytes(int64_t shard_numel, c10::ScalarType orig_dtype, c10::ScalarType param_dtype) const override {
    return orig_dtype == param_dtype ? 0 : shard_numel * static_cast<int64_t>(c10::elementSize(param_dtype));
  }
  int64_t unpack_bytes(int64_t, c10::ScalarType) const override { return 0; }
};

}  // namespace

std::shared_ptr<const GatherSeam> cast_gather() {
  static const auto seam = std::make_shared<const CastGather>();
  return seam;
}

}  // namespace shardlab::fsdp
