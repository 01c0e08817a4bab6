#pragma once
/// @file wire.h
/// The dtype a gradient reduction communicates in: its own, or a half-size copy (PyTorch DDP's fp16/bf16
/// compression hooks; FSDP's reduce_dtype). One name for what DDP's compression and HSDP's reduction both choose.

#include <c10/core/ScalarType.h>

#include <string>

namespace shardlab {

/// The dtype a reduction communicates in.
enum class Wire {
  kReduceDtype,  ///< the gradients' reduce dtype, as they come (FSDP's MixedPrecision::reduce_dtype)
  kFloat16,      ///< a half-size copy in fp16 (the fp16 compression hook)
  kBFloat16,     ///< a half-size copy in bf16 (Gloo 1.13 carries it as f32: Note [Fallbacks])
};

/// "reduce_scatter" -> kReduceDtype, "fp16", "bf16" (the names of the course's reduce-scatter hooks).
/// @throws std::invalid_argument naming the accepted names.
Wire parse_wire(const std::string& name);

/// The name parse_wire reads back: "reduce_scatter", "fp16" or "bf16".
const char* wire_name(Wire wire);

/// The dtype that `wire` sends gradients of dtype `reduce` in.
c10::ScalarType wire_dtype(Wire wire, c10::ScalarType reduce);

}  // namespace shardlab
