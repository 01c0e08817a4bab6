#pragma once
/// @file text_gather.h
/// Every rank's text, on every rank: how ranks agree on an outcome (an error one of them met, the pieces of a
/// checkpoint each wrote) before any of them goes on.

#include "shardlab/common/communicator.h"

#include <string>
#include <vector>

namespace shardlab {

/// All-gathers `text` from every rank of `comm`: element r of the result is rank r's text, on every rank. Two
/// collectives (the lengths, then the texts padded to the longest), so ranks with texts of different lengths pair
/// safely. On NCCL the bytes travel through the current CUDA device. A collective: every rank calls it.
/// @throws std::runtime_error (from the Communicator) when a collective fails or times out.
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text);

}  // namespace shardlab
