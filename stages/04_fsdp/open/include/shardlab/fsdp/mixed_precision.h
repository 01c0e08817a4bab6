#pragma once
/// @file mixed_precision.h
/// Stage 04 — the mixed-precision policy: which dtype parameters are gathered and computed in, and which dtype
/// gradients are reduced in (PyTorch FSDP2's MixedPrecisionPolicy, with its clamping rules).
///
/// Vocabulary:
///  - *original dtype*: the parameter's own dtype. The sharded parameter, its gradient and the optimizer's state
///    always stay in it (no extra high-precision copy is needed: the shard *is* the master copy).
///  - *param dtype*: the all-gather and the forward/backward compute run in it.
///  - *reduce dtype*: the reduce-scatter runs in it, and gradients accumulated over `no_sync` micro-batches are
///    kept in it.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace shardlab::fsdp {

/// What the user asks for; an empty field means "the dtype before it" (param: original; reduce: param).
struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;   ///< gather and compute dtype (e.g. bf16)
  std::optional<c10::ScalarType> reduce_dtype;  ///< reduce-scatter and accumulation dtype (e.g. f32)
};

/// The dtypes one unit really uses, after FSDP2's clamping.
struct UnitDtypes {
  c10::ScalarType orig;    ///< the parameters' dtype: sharded params, sharded grads, optimizer state
  c10::ScalarType param;   ///< all-gather and compute
  c10::ScalarType reduce;  ///< reduce-scatter and unsharded accumulation
  /// True when the gathered parameters are a cast of the shards.
  bool casts_params() const { return param != orig; }
};

/// Applies the policy to parameters of dtype `orig`: a non-floating parameter is never cast (param = reduce =
/// orig); an unset param dtype is `orig`; an unset reduce dtype is the param dtype (so reduce == param means no
/// cast of the gradients before the reduce-scatter).
/// @throws std::invalid_argument when a requested dtype is not floating point.
UnitDtypes resolve_dtypes(const MixedPrecision& policy, c10::ScalarType orig);

/// "float32", "bfloat16", "float16", "float64": the names `--param-dtype` / `--reduce-dtype` take.
/// @throws std::invalid_argument listing the accepted names.
c10::ScalarType parse_dtype(const std::string& name);

}  // namespace shardlab::fsdp
