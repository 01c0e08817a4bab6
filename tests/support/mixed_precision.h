#pragma once
// The mixed-precision policy the FSDP and HSDP tests train with: bf16 parameters in the forward and backward, the
// gradients reduced in f32 into f32 shards.
#include "shardlab/fsdp/fsdp.h"

#include <ATen/ATen.h>

namespace shardlab::test_support {

/// FSDP options with bf16 compute and an f32 reduction (mixed_precision.param_dtype, reduce_dtype), the rest default.
inline fsdp::Options bf16_compute_f32_reduce() {
  fsdp::Options options;
  options.mixed_precision.param_dtype = at::kBFloat16;
  options.mixed_precision.reduce_dtype = at::kFloat;
  return options;
}

}  // namespace shardlab::test_support
