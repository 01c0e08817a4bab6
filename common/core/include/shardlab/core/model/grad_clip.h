#pragma once
/// @file grad_clip.h
/// Gradient clipping by the global norm, over gradients that may be sharded across ranks: PyTorch's
/// `clip_grad_norm_` for every wrapper. See Note [A norm over shards] in grad_clip.cpp.

#include "shardlab/core/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace shardlab {

/// The p-norm of all the gradients of `params` taken together, as one vector: (sum over elements of |g|^p)^(1/p), or
/// max |g| for p = infinity. Undefined gradients count as zero; a parameter listed twice (a tied weight) counts
/// once. Accumulated in float64.
/// @param params the parameters whose `.grad()` count (this rank's shards, or a whole replica).
/// @param p the norm: > 0; 2 for the Euclidean norm, infinity for the largest |g|.
/// @param comm the group whose ranks hold *distinct* parts of the gradients (FSDP's shard group; never the
///        replicas of HSDP), over which one all-reduce (SUM of |g|^p, or MAX) joins them; null when this rank holds
///        the whole gradient (DDP after its averaging): no collective. A collective when not null: every rank of
///        `comm` calls it at the same point.
/// @throws std::invalid_argument when p is not positive (NaN included).
double total_grad_norm(const std::vector<at::Tensor>& params, double p, Communicator* comm);

/// Scales every gradient of `params` by min(1, max_norm / (total + 1e-6)), as torch.nn.utils.clip_grad_norm_ does
/// (a NaN total makes every gradient NaN there too), where total is total_grad_norm(params, p, comm), and returns
/// total (before scaling).
/// @throws std::invalid_argument when max_norm is negative or not finite, or p is not positive.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double p, Communicator* comm);

}  // namespace shardlab
