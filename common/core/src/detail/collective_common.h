#pragma once
// Internal to shardlab::core (not installed): the small helpers that several of the Communicator's source files
// share (comm/dispatch.cpp, collective_paths.cpp, collective_checks.cpp, collectives.cpp, ring_collectives.cpp).
// Each is defined once, in the file of the concept it belongs to, named beside its declaration.

#include "shardlab/core/comm/communicator.h"

#include <c10/core/ScalarType.h>

namespace shardlab::detail {

/// True when this build's Gloo reduces `t` itself (bfloat16 only where compat::gloo_features() says so); false for
/// a dtype it cannot carry. In collective_paths.cpp.
bool gloo_supports(c10::ScalarType t);

/// The reduction's name as CollectiveRecord::reduce and the check's messages write it ("sum", "avg", "max").
/// In dispatch.cpp.
const char* reduce_name(ReduceOp op);

/// Warns once per process that `op` sent bf16 as f32 (Note [Fallbacks]; tier 3 of Note [Three error tiers]).
/// In collectives.cpp.
void warn_bf16_sent_as_f32(const char* op);

}  // namespace shardlab::detail
