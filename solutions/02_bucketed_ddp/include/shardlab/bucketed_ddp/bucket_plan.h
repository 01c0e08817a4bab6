#pragma once
/// @file bucket_plan.h
/// Stage 02 — which gradients travel together: grouping parameters into buckets by a byte cap.
///
/// A *bucket* is a set of parameters of one dtype whose gradients sit next to each other in a flat buffer and are
/// averaged by one all-reduce. Buckets follow the order in which gradients are expected to become ready in
/// backward, so the first bucket fills up (and its all-reduce starts) while backward is still computing the rest.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace shardlab::bucketed_ddp {

/// Byte caps of the buckets, as in PyTorch DDP: the first bucket of each dtype is small so that communication
/// starts early in backward; every later one is large so that there are few collectives.
struct BucketCaps {
  int64_t first_bytes = int64_t{1} << 20;  ///< cap of the first bucket of each dtype (default 1 MiB)
  int64_t bytes = int64_t{25} << 20;       ///< cap of every later bucket (default 25 MiB)
};

/// Checks that both caps are positive.
/// @param who the caller, named first in the error (e.g. "BucketedDDP::set_caps").
/// @param caps the caps to check.
/// @throws std::invalid_argument naming `who` and both caps, and saying they must be positive, when one is not.
void check_caps(const char* who, BucketCaps caps);

/// Groups parameters into buckets.
///
/// Rule (PyTorch DDP's): walk `order`; each parameter joins the open bucket of its dtype; a bucket closes as soon
/// as it holds at least its cap, so a bucket exceeds its cap by at most its last parameter, and a parameter larger
/// than the cap gets a bucket of its own. Buckets are returned sorted by the position in `order` of their first
/// parameter; inside a bucket, parameters keep their order from `order`.
///
/// @param params the parameters (only dtype, numel and element size are read).
/// @param order a permutation of [0, params.size()): the expected gradient-ready order.
/// @param caps the byte caps; both must be positive.
/// @return for each bucket, the indices (into `params`) of its parameters.
/// @throws std::invalid_argument when `order` is not a permutation or a cap is not positive.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                                BucketCaps caps);

}  // namespace shardlab::bucketed_ddp
