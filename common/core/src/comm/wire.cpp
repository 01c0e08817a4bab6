#include "shardlab/core/comm/wire.h"

#include <stdexcept>

namespace shardlab {

Wire parse_wire(const std::string& name) {
  if (name == "reduce_scatter") return Wire::kReduceDtype;
  if (name == "fp16") return Wire::kFloat16;
  if (name == "bf16") return Wire::kBFloat16;
  throw std::invalid_argument("unknown reduction '" + name + "'; expected reduce_scatter, fp16 or bf16");
}

const char* wire_name(Wire wire) {
  switch (wire) {
    case Wire::kFloat16:
      return "fp16";
    case Wire::kBFloat16:
      return "bf16";
    case Wire::kReduceDtype:
      break;
  }
  return "reduce_scatter";
}

c10::ScalarType wire_dtype(Wire wire, c10::ScalarType reduce) {
  switch (wire) {
    case Wire::kFloat16:
      return c10::kHalf;
    case Wire::kBFloat16:
      return c10::kBFloat16;
    case Wire::kReduceDtype:
      break;
  }
  return reduce;
}

}  // namespace shardlab
