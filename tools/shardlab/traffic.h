#pragma once
// What each strategy should send per step, in theory (Strategy::theory): counted from the model's layout and the
// algorithm as documented, apart from the code that sends it, so that the report's measured traffic checks the
// code against something it did not compute itself.

#include "strategies.h"

#include "shardlab/bucketed_ddp/bucket_plan.h"
#include "shardlab/core/model/model.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shardlab::cli {

/// The run's bucket caps (--first-bucket-kb, --bucket-cap-kb).
bucketed_ddp::BucketCaps caps(const StrategyOptions& s);

/// Naive DDP's traffic: one all-reduce per trainable parameter, of its full size (an upper bound when a parameter
/// can go without a gradient in a step, as the edge model's `sometimes` does on odd steps).
Theory per_parameter_all_reduce(const Model& model);

/// How many buckets the cap rule of bucket_plan.h makes of `params` taken in `order` (counted from the rule as
/// documented, not with stage 02's assign_buckets).
int64_t buckets_by_cap_rule(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                            const bucketed_ddp::BucketCaps& caps);

/// Bucketed DDP's traffic: one all-reduce per bucket of the whole gradient, `scale` times its size (0.5 when
/// compressed to 16 bits).
Theory per_bucket_all_reduce(const Model& model, const StrategyOptions& s, double scale);

/// Stage 04's FSDP on `world` ranks: every micro-batch but the last under no_sync, so one reduce-scatter per unit
/// per step.
Theory fsdp_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train);

/// HSDP on the mesh of mesh_shape(): FSDP's traffic on the shard group, one all-reduce per unit on the replicate
/// group.
Theory hsdp_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train);

}  // namespace shardlab::cli
