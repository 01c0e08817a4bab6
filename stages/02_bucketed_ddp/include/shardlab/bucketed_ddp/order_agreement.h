#pragma once
/// @file order_agreement.h
/// Stage 02 — ranks agree on one gradient-ready order before they rebuild their buckets.
///
/// Each rank records the order in which its gradients became ready; threads, timing or data can make those orders
/// differ between ranks. Buckets must be identical on every rank (collectives are matched by order and size), so
/// one rank decides: rank 0's order wins, as in PyTorch DDP's bucket rebuild.

#include "shardlab/core/comm/communicator.h"

#include <c10/core/Device.h>

#include <vector>

namespace shardlab::bucketed_ddp {

/// Returns rank 0's `order` on every rank of `comm`. A collective: every rank calls it with an order of the same
/// length (a permutation of [0, n) on rank 0; the other ranks' values are only overwritten).
///
/// The order travels as one tensor of n int64 on `device`, which must be the device the group's backend moves:
/// the parameters' device (NCCL moves only CUDA tensors, Gloo both). One broadcast, waited for before returning.
/// @throws std::invalid_argument when an entry does not fit in an int64.
std::vector<size_t> agree_on_order(Communicator& comm, const std::vector<size_t>& order, c10::Device device);

}  // namespace shardlab::bucketed_ddp
