// The traffic each strategy should send, in theory (traffic.h).
#include "traffic.h"

#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/device/device.h"
#include "shardlab/fsdp/mixed_precision.h"
#include "shardlab/fsdp/shard_layout.h"

#include <c10/core/ScalarType.h>

#include <map>
#include <set>

namespace shardlab::cli {
namespace {

// Bytes one reduction of every trainable gradient sends, `scale` times its own size (0.5 when compressed to 16
// bits): what the algorithm asks for. (Gloo 1.13 sends bf16 as f32; the report shows the measured bytes beside.)
double payload_bytes(const Model& model, double scale) {
  double bytes = 0;
  for (const auto& p : trainable_parameters(model)) bytes += static_cast<double>(p.numel() * p.element_size()) * scale;
  return bytes;
}

// The same, in reverse registration order (the layout before the first rebuild).
int64_t buckets_in_reverse_order(const std::vector<at::Tensor>& params, const bucketed_ddp::BucketCaps& caps) {
  std::vector<size_t> reversed(params.size());
  for (size_t i = 0; i < params.size(); ++i) reversed[i] = params.size() - 1 - i;
  return buckets_by_cap_rule(params, reversed, caps);
}

// One FSDP unit as theory sees it, on a group of `world` ranks: Σ padded shard numel of its parameters, of its
// trainable ones (a gradient row), and whether it is the root (the parameters of no unit).
struct UnitShards {
  double shard = 0;
  double grad_row = 0;
  bool root = false;
};

// The units of `model` sharded `world` ways: its blocks, then the root when it has parameters.
std::vector<UnitShards> unit_shards(const Model& model, int world) {
  std::vector<UnitShards> units;
  std::set<const c10::TensorImpl*> in_unit;
  auto add = [&](const std::vector<at::Tensor>& params, bool root) {
    UnitShards u;
    u.root = root;
    for (const auto& p : params) {
      const auto spec = fsdp::shard_spec(p.sizes(), world);
      u.shard += static_cast<double>(spec.padded_numel());
      if (p.requires_grad()) u.grad_row += static_cast<double>(spec.padded_numel());
    }
    units.push_back(u);
  };
  for (const auto& unit : model.units()) {
    const auto params = unit.module->parameters();
    for (const auto& p : params) in_unit.insert(p.unsafeGetTensorImpl());
    add(params, false);
  }
  std::vector<at::Tensor> root;  // a tied weight once
  for (const auto& [name, p] : named_state(model, StateParts::kParameters, /*once=*/true))
    if (!in_unit.count(p.unsafeGetTensorImpl())) root.push_back(p);
  if (!root.empty()) add(root, true);
  return units;
}

// Bytes per element of the gathered parameters and of the reduced gradients.
double param_elem(const StrategyOptions& s) {
  return s.param_dtype.empty() ? 4.0 : static_cast<double>(c10::elementSize(fsdp::parse_dtype(s.param_dtype)));
}
double reduce_elem(const StrategyOptions& s) {
  const std::string reduce = s.reduce_dtype.empty() ? s.param_dtype : s.reduce_dtype;
  return reduce.empty() ? 4.0 : static_cast<double>(c10::elementSize(fsdp::parse_dtype(reduce)));
}

// FSDP's traffic per step on a group of `world` ranks, from the layout: forward gathers every unit once, backward
// gathers the units again when they were freed (raf) and reduce-scatters every unit with trainable parameters
// `reduces` times; every micro-batch gathers. Bytes are what rank 0 hands to the backend: its padded shards for an
// all-gather; for a reduce-scatter, N-1 of the N rows of padded gradients on CPU where the ring pays (Note [Ring
// reduce-scatter]) or all N (NCCL's own, Gloo's all-reduce fallback).
Traffic sharded_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train,
                        int reduces) {
  const double elem = param_elem(s), relem = reduce_elem(s);
  Traffic t;
  for (const UnitShards& u : unit_shards(model, world)) {
    const int gathers = (1 + (!u.root && s.reshard_after_forward ? 1 : 0)) * train.micro_batches;
    const int rs = u.grad_row > 0 ? reduces : 0;
    t.collectives += gathers + rs;
    const bool ring = parse_device(train.device).is_cpu() &&
                      ring_reduce_scatter_pays(world, static_cast<int64_t>(world * u.grad_row * relem));
    const int rows_sent = ring ? world - 1 : world;
    t.bytes += gathers * u.shard * elem + rs * rows_sent * u.grad_row * relem;
  }
  if (train.clip_norm > 0 && world > 1) {  // the clip's all-reduce of one double joins the shards' norms
    t.collectives += 1;
    t.bytes += 8;
  }
  return t;
}

}  // namespace

bucketed_ddp::BucketCaps caps(const StrategyOptions& s) { return {s.first_bucket_cap_bytes, s.bucket_cap_bytes}; }

// Naive DDP's traffic: one all-reduce per trainable parameter, of its full size (an upper bound when a
// parameter can go without a gradient in a step, as the edge model's `sometimes` does on odd steps).
Theory per_parameter_all_reduce(const Model& model) {
  return {static_cast<double>(trainable_parameters(model).size()), payload_bytes(model, 1.0), {}};
}

// How many buckets the cap rule of bucket_plan.h makes of `params` taken in `order`. Counted here from the rule
// as documented, not with stage 02's assign_buckets: the theory must come from somewhere else than the code it
// checks, or a wrong cap rule would agree with itself. The rule: per dtype, gradients join the open bucket in turn;
// a bucket closes once it holds at least its cap (first_bytes for the first bucket of each dtype, bytes after), and
// whatever is still open at the end is one more bucket.
int64_t buckets_by_cap_rule(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                            const bucketed_ddp::BucketCaps& caps) {
  struct Open {
    int64_t bytes = 0;
    size_t params = 0;
    bool first = true;
  };
  std::map<c10::ScalarType, Open> open;
  int64_t closed = 0;
  for (size_t i : order) {
    const at::Tensor& p = params.at(i);
    Open& b = open[p.scalar_type()];
    b.bytes += p.numel() * static_cast<int64_t>(p.element_size());
    ++b.params;
    if (b.bytes >= (b.first ? caps.first_bytes : caps.bytes)) {
      ++closed;
      b = Open{0, 0, false};
    }
  }
  for (const auto& [dtype, b] : open) closed += b.params > 0 ? 1 : 0;
  return closed;
}

// Bucketed DDP's traffic: one all-reduce per bucket (laid out in reverse registration order, as before the
// rebuild; the rebuild keeps the count for these models), of the whole gradient, on the replicate group of its Nx1
// mesh.
Theory per_bucket_all_reduce(const Model& model, const StrategyOptions& s, double scale) {
  const Traffic t{static_cast<double>(buckets_in_reverse_order(trainable_parameters(model), caps(s))),
                  payload_bytes(model, scale)};
  return {t.collectives, t.bytes, {{"replicate", t}}};
}

// Stage 04's FSDP: every micro-batch but the last under no_sync, so one reduce-scatter per unit per step, on the
// shard group of its 1xN mesh.
Theory fsdp_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train) {
  const Traffic t = sharded_traffic(model, world, s, train, 1);
  return {t.collectives, t.bytes, {{"shard", t}}};
}

// HSDP on an R x S mesh: FSDP's traffic on the shard group (S ranks; k reduce-scatters per step when the
// all-reduce is deferred over k micro-batches, else one), and on the replicate group one all-reduce per unit with
// trainable parameters per step, of its gradient row (Σ padded shard numel, padding included) in the reduce dtype.
// One replica (R = 1) has no replicate traffic at all.
Theory hsdp_traffic(const Model& model, int world, const StrategyOptions& s, const TrainConfig& train) {
  const auto [replicas, shards] = mesh_shape(s, world);
  const Traffic shard = sharded_traffic(model, shards, s, train, s.defer_all_reduce ? train.micro_batches : 1);
  Traffic replicate;
  if (replicas > 1)
    for (const UnitShards& u : unit_shards(model, shards))
      if (u.grad_row > 0) {
        replicate.collectives += 1;
        replicate.bytes += u.grad_row * reduce_elem(s);
      }
  Theory t{shard.collectives + replicate.collectives, shard.bytes + replicate.bytes, {{"shard", shard}}};
  if (replicas > 1) t.groups["replicate"] = replicate;
  return t;
}

}  // namespace shardlab::cli
