#pragma once
/// @file model_check.h
/// Ranks that disagree, caught at construction: every rank's model structure compared with rank 0's before any
/// training collective, as PyTorch DDP does when it is built (its `_verify_param_shape_across_processes`).
///
/// Why: every wrapper pairs its collectives by position and sizes them from the model. A rank whose model differs
/// (a layer one row larger, a parameter registered in another order, another dtype) would otherwise train on
/// silently where the padded sizes happen to agree, or make the backend fail on its own thread where they do not.
/// See Note [Comparing the ranks' models] in model_check.cpp.

#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/model.h"

#include <string>
#include <vector>

namespace shardlab {

/// The model's structure as every rank must see it, one entry per line, in the order the wrappers walk it: its
/// units (index and name), then every parameter (full name, sizes, dtype, device type, requires_grad), then every
/// buffer (name, sizes, dtype, device type). Device indices are left out: on NCCL rank r uses cuda:r.
/// Example entry: "parameter 'block0.fc.weight': sizes [2, 7], Float, cpu, requires_grad". A line break in a
/// name is written as "\n".
std::vector<std::string> model_structure(const Model& model);

/// A collective over `comm`: checks that every rank's model_structure(model) equals rank 0's. The common case is one
/// all-gather of a small fixed-size digest; only when digests differ does a second all-gather bring every rank's
/// structure, so that every rank throws the same message. `who` prefixes every message (e.g. "NaiveDDP").
/// Every rank of `comm` must call it at the same point.
/// @throws std::invalid_argument on every rank when the structures differ, naming the first entry that differs,
///         the ranks that differ from rank 0, and both values.
/// @throws std::runtime_error naming this rank, the group and the check when a collective of the check fails, e.g.
///         when a rank does not arrive within the group's timeout.
/// What it cannot see: the wrappers' options (bucket caps, mixed precision, resharding), which also size
/// collectives; every rank must pass the same.
void check_same_model(const Model& model, Communicator& comm, const std::string& who);

}  // namespace shardlab
