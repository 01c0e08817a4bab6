#pragma once
/// @file cap_tuning.h
/// Stage 02 — bucket caps from a measured cost model, instead of by hand.
///
/// PyTorch users tune DDP's `bucket_cap_mb` by hand. The right caps depend on three things this module measures or
/// is told: what one all-reduce costs on this group (a latency alpha and a time per byte beta, fitted from a few
/// timed all-reduces), when each gradient becomes ready in backward (recorded by BucketedDDP), and the bytes of each
/// gradient. Small buckets start early but pay alpha often; large ones pay it rarely but start late. The model
/// replays one backward for a pair of caps and returns the communication left after backward's compute ended (the
/// *exposed* time); `choose_caps` searches a grid of caps for the pair that exposes least.
///
/// Note [The bucket timeline model]
/// The timeline the model replays:
///   bucket b is complete at  ready_b  = the latest ready time of its parameters;
///   it is launched at        launch_b = max(ready_b, launch_{b-1})           (buckets go out in order);
///   it runs from             start_b  = max(launch_b, end_{b-1})             (one collective at a time);
///   until                    end_b    = start_b + alpha + beta * bytes_b;
///   exposed                           = max(0, end_last - backward_end).
/// It ignores that communication and compute share the cores (on 2 cores they do): a model, checked against the
/// measured exposed time in `shardlab train --bucket-cap-kb auto`, which prints both.

#include "shardlab/bucketed_ddp/bucket_plan.h"
#include "shardlab/core/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace shardlab::bucketed_ddp {

/// What one all-reduce of `bytes` costs, modelled as alpha + beta * bytes.
struct LinkCost {
  double alpha_ns = 0;          ///< fixed cost per collective
  double beta_ns_per_byte = 0;  ///< cost per byte of payload
  /// The modelled time of one all-reduce of `bytes`, in ns.
  double ns(int64_t bytes) const { return alpha_ns + beta_ns_per_byte * static_cast<double>(bytes); }
};

/// Least-squares fit of alpha + beta * bytes to `samples` (bytes, ns); negative coefficients are clamped to 0.
/// @throws std::invalid_argument with fewer than two distinct sizes.
LinkCost fit_link_cost(const std::vector<std::pair<int64_t, double>>& samples);

/// Times `repeats` all-reduces (average, float32, on `device`) of each size in `sizes_bytes` on `comm`, after one
/// warm-up each, takes each size's median, fits alpha and beta, and averages the fit over the ranks so every rank
/// holds the same figures. A collective: every rank calls it at the same point.
LinkCost measure_all_reduce_cost(Communicator& comm, c10::Device device,
                                 const std::vector<int64_t>& sizes_bytes = {4 << 10, 64 << 10, 512 << 10},
                                 int repeats = 9);

/// One backward as the model sees it: per parameter its gradient's bytes and dtype (params) and the time its
/// gradient became ready (ready_ns, same indexing), the order they became ready in, and when backward's compute
/// ended (all times on one clock, e.g. now_ns()).
struct BackwardProfile {
  std::vector<at::Tensor> params;  ///< only dtype, numel and element size are read
  std::vector<int64_t> ready_ns;   ///< per parameter: when its gradient became ready
  std::vector<size_t> order;       ///< the parameters in the order they became ready
  int64_t end_ns = 0;              ///< when backward's compute ended
};

/// The modelled exposed communication (ns) of one backward with `caps`: buckets by `assign_buckets` over
/// `profile.order`, then the timeline of Note [The bucket timeline model].
double modelled_exposed_ns(const BackwardProfile& profile, BucketCaps caps, LinkCost cost);

/// The caps to use: the pair from `grid` x `grid` (first cap, later cap; every value in bytes) whose modelled
/// exposed time is least; ties go to fewer buckets, then to the larger first cap, then to the larger later cap.
/// @param profile the backward to replay (BucketedDDP::last_backward_profile()).
/// @param cost the group's all-reduce cost (measure_all_reduce_cost).
/// @param grid candidate caps in bytes (default: powers of two from 1 KiB up to the first at or above all the
///        gradients' bytes).
/// @param in_use the caps in use, if any: returned unless the grid's pair models strictly less exposure (the grid
///        may not hold them, and a change of layout is not free).
/// @throws std::invalid_argument for an empty profile, a non-positive candidate or non-positive caps in use.
BucketCaps choose_caps(const BackwardProfile& profile, LinkCost cost, std::vector<int64_t> grid = {},
                       std::optional<BucketCaps> in_use = std::nullopt);

}  // namespace shardlab::bucketed_ddp
