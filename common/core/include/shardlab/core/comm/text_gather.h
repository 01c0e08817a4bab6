#pragma once
/// @file text_gather.h
/// Every rank's text, on every rank: how ranks agree on an outcome (an error one of them met, the pieces of a
/// checkpoint each wrote) before any of them goes on.

#include "shardlab/core/comm/communicator.h"

#include <functional>
#include <string>
#include <vector>

namespace shardlab {

/// All-gathers `text` from every rank of `comm`: element r of the result is rank r's text, on every rank. Two
/// collectives (the lengths, then the texts padded to the longest), so ranks with texts of different lengths pair
/// safely. On NCCL the bytes travel through the current CUDA device. A collective: every rank calls it.
/// @throws std::runtime_error (from the Communicator) when a collective fails or times out.
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text);

/// Runs `step` on this rank, then tells every rank how it went on every rank (one all_gather_text of the errors), so
/// that a rank whose step threw never leaves the others waiting in a later collective. A collective: every rank
/// calls it, whether its own step throws or not.
/// @param comm the group that agrees.
/// @param what names the step for the others' error ("FullyShardedModel: building the model").
/// @param step what this rank does; it must issue no collective on `comm`.
/// @throws what `step` threw on this rank (rethrown as it was); else std::runtime_error "<what> failed on rank r, so
///         no rank goes on: <its message>" for the lowest rank whose step threw.
void run_agreed(Communicator& comm, const std::string& what, const std::function<void()>& step);

}  // namespace shardlab
