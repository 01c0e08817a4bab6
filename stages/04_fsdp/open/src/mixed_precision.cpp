#include "shardlab/fsdp/mixed_precision.h"

#include <stdexcept>

namespace shardlab::fsdp {

UnitDtypes resolve_dtypes(const MixedPrecision& policy, c10::ScalarType orig) {
  for (const auto& d : {policy.param_dtype, policy.reduce_dtype})
    if (d && !c10::isFloatingType(*d))
      throw std::invalid_argument(std::string("MixedPrecision: expected a floating dtype; got ") + c10::toString(*d));
  UnitDtypes out{orig, orig, orig};
  if (!c10::isFloatingType(orig)) return out;  // integer parameters are never cast
  out.param = policy.param_dtype.value_or(orig);
  out.reduce = policy.reduce_dtype.value_or(out.param);
  return out;
}

c10::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32" || name == "float") return c10::kFloat;
  if (name == "bfloat16" || name == "bf16") return c10::kBFloat16;
  if (name == "float16" || name == "fp16" || name == "half") return c10::kHalf;
  if (name == "float64" || name == "fp64" || name == "double") return c10::kDouble;
  throw std::invalid_argument("unknown dtype '" + name + "'; expected float32, bfloat16, float16 or float64");
}

}  // namespace shardlab::fsdp
