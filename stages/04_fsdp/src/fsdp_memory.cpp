// FullyShardedModel's memory theory: the peaks a step should reach for this layout, these options and this
// schedule (MemoryTheory), walked over the expected forward and its backward. What MemoryMeter measures (memory.h:
// the parameters' buffers where they are allocated) is compared with it.
#include "shardlab/fsdp/fsdp.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab::fsdp {

// Note [The parameter peak, walked]
// The peak is not one formula: it depends on which units stay gathered (the root; every unit without raf) and on
// what is in flight beside the unit at its copy-out. So the theory walks the forward in its expected order
// (expected_forward_order(): the last forward's, or registration order with the root first; a prefetch schedule
// predicts the same) and keeps the largest of, at each unit u:
//  - its copy-out: what stays gathered so far + u's gathered buffer + u's all-gather buffers (and one block the gather
//    seam unpacks) + those of the units already ahead beside it (the next k-1 when k units may be ahead; none before
//    the first unit);
//  - right after it, when the schedule prefetches: the same without u's all-gather buffer, with the next k units'.
// The walk is the steady state: a forward that runs its units in the expected order. A forward that does not (the
// first one of a model registered in another order than it runs, or one that skips a unit) may hold a prefetched
// unit's all-gather buffer beside units it was not expected beside, until its use or the end of the forward; the
// next forward expects the new order.
// Backward with raf meets the same moments in the reverse order (a unit is freed when its gradients are in, before
// the next unit's copy-out), except that a unit with a frozen parameter stays gathered to the end of backward: a
// second walk, over the backward, counts those.
int64_t FullyShardedModel::parameter_peak(int64_t ahead) const {
  const std::vector<size_t> order = expected_forward_order();
  const auto is_root = [&](size_t u) { return has_root_ && u + 1 == units_.size(); };
  int64_t shards = 0;
  for (const auto& unit : units_) shards += unit->sharded_bytes();
  // Walks `units` in the order they are gathered from `held` bytes on; `stays(u)`: u stays gathered after its use.
  auto walk = [&](const std::vector<size_t>& units, int64_t held, const auto& stays) {
    int64_t peak = held;
    auto next_all_gathers = [&](size_t i, int64_t count) {
      int64_t bytes = 0;
      for (size_t j = i + 1; j < units.size() && static_cast<int64_t>(j - i) <= count; ++j)
        bytes += units_[units[j]]->all_gather_bytes();
      return bytes;
    };
    for (size_t i = 0; i < units.size(); ++i) {
      const FsdpUnit& unit = *units_[units[i]];
      const int64_t beside = i == 0 ? 0 : next_all_gathers(i, ahead - 1);
      const int64_t gathered = held + unit.gathered_capacity_bytes();
      peak = std::max({peak, gathered + unit.all_gather_bytes() + unit.unpack_bytes() + beside,
                       gathered + next_all_gathers(i, ahead)});
      if (stays(units[i])) held = gathered;
    }
    return peak;
  };
  // Forward: the root (its forward is the whole loss) and every unit without raf stay gathered.
  int64_t peak = walk(order, shards, [&](size_t u) { return is_root(u) || !raf(u); });
  if (options_.reshard_after_forward) {
    // Backward gathers the units again in the reverse order, the root gathered throughout; a unit with a frozen
    // parameter stays gathered to the end of backward (Note [When a unit may be freed in backward]).
    std::vector<size_t> backward;
    for (auto it = order.rbegin(); it != order.rend(); ++it)
      if (!is_root(*it)) backward.push_back(*it);
    const int64_t root = has_root_ ? units_.back()->gathered_capacity_bytes() : 0;
    peak = std::max(peak, walk(backward, shards + root, [&](size_t u) { return units_[u]->has_frozen(); }));
  }
  return peak;
}

// Note [The gradient peak, walked]
// A synchronized backward meets the units in the reverse of the forward order, the root last (its gradients are
// complete only when the embedding's, the last, has come). At each unit u:
//  - while u's backward runs, its unsharded gradients come in beside the previous unit's reduction, still in
//    flight (one at a time: Note [One reduce-scatter in flight]);
//  - when u is ready, the previous reduction is advanced (a one-phase one waited for, its buffers freed; a two-phase
//    one keeps its second phase's bytes to the end of backward: Note [A reduction's bytes, phase by phase]) and u's
//    buffers made while its unsharded gradients still exist; they are freed as they are copied in.
// Beside every moment: the sharded gradients (all of them: after the first step they stay), and the root's
// unsharded gradients, counted whole from the start. That last term makes the theory an upper bound: the root's
// gradients do not all come at the start (the head's does, the embedding's comes last), and nothing tells when
// each will.
// With accumulation under no_sync (Accumulation::kNoSync), every unit's gradients from the earlier micro-batches are
// there when the last backward starts: in `.grad()` (reduce dtype = param dtype: autograd adds the last
// micro-batch's in place) or in reduce-dtype accumulators, beside which the last micro-batch's come in the param
// dtype. Each unit's are freed as its reduction's input is laid out, so the peak is at the first units of backward.
// When every micro-batch reduces (kReduce), nothing unsharded is kept, but a reducer may keep a partial row per
// unit between them (GradientReducer::deferred_bytes: HSDP's deferred all-reduce); it goes into the last
// micro-batch's reduction and is freed with its first phase. The last micro-batch is the largest: the earlier ones
// hold the same partials and no second phases.
int64_t FullyShardedModel::gradient_peak(int micro_batches, Accumulation accumulation) const {
  const bool no_sync = micro_batches > 1 && accumulation == Accumulation::kNoSync;
  const bool partials = micro_batches > 1 && accumulation == Accumulation::kReduce;
  const std::vector<size_t> order = expected_forward_order();
  int64_t held = 0;
  for (const auto& unit : units_)
    for (const auto& fp : unit->params())
      if (fp.trainable) held += fp.sharded.numel() * static_cast<int64_t>(c10::elementSize(unit->dtypes().orig));
  // What accumulation keeps of unit u from the earlier micro-batches, and what the last one adds beside it.
  auto kept = [&](const FsdpUnit& u) {
    if (partials) return u.deferred_bytes();
    if (!no_sync) return int64_t{0};
    const int64_t numel = u.unsharded_grad_bytes() / static_cast<int64_t>(c10::elementSize(u.dtypes().param));
    return numel * static_cast<int64_t>(c10::elementSize(u.dtypes().reduce));
  };
  auto incoming = [&](const FsdpUnit& u) {
    const bool in_place = no_sync && u.dtypes().reduce == u.dtypes().param;
    return in_place ? int64_t{0} : u.unsharded_grad_bytes();
  };
  for (const auto& unit : units_) held += kept(*unit);
  if (has_root_) held += incoming(*units_.back());  // the root's: counted from the start (an upper bound)
  // The backward reduces in reverse forward order, then (at its end, as zeros) the trainable units the forward
  // did not run: launch_ready_reductions' order.
  std::vector<size_t> walk(order.rbegin(), order.rend());
  for (size_t u = 0; u < units_.size(); ++u)
    if (std::find(order.begin(), order.end(), u) == order.end()) walk.push_back(u);
  int64_t peak = held, in_flight = 0, in_flight_second = 0, second_phases = 0;
  for (size_t u : walk) {
    const FsdpUnit& unit = *units_[u];
    if (unit.trainable_count() == 0) continue;
    const bool is_root = has_root_ && u + 1 == units_.size();
    const int64_t grads = is_root ? 0 : incoming(unit);  // the root's are in `held`
    peak = std::max(peak, held + second_phases + in_flight + grads);
    second_phases += in_flight_second;  // the previous reduction advanced
    peak = std::max(peak, held + second_phases + grads + unit.reduce_bytes());
    held -= kept(unit);  // laid out into the reduction's input (no_sync), or taken in by it (a partial)
    in_flight = unit.reduce_bytes() + (partials ? kept(unit) : 0);
    in_flight_second = unit.second_phase_bytes();
  }
  return std::max(peak, held + second_phases + in_flight);
}

MemoryTheory FullyShardedModel::memory_theory(int micro_batches, Accumulation accumulation) const {
  if (micro_batches < 1)
    throw std::invalid_argument("memory_theory: expected micro_batches >= 1; got " + std::to_string(micro_batches));
  MemoryTheory t;
  for (size_t u = 0; u < units_.size(); ++u) {
    const FsdpUnit& unit = *units_[u];
    const bool is_root = has_root_ && u + 1 == units_.size();
    t.sharded_param_bytes += unit.sharded_bytes();
    const int64_t unsharded_grads = unit.unsharded_grad_bytes();
    for (const auto& fp : unit.params())
      if (fp.trainable)
        t.sharded_grad_bytes += fp.sharded.numel() * static_cast<int64_t>(c10::elementSize(unit.dtypes().orig));
    t.largest_reduce_bytes = std::max(t.largest_reduce_bytes, unit.reduce_bytes());
    t.largest_all_gather_bytes = std::max(t.largest_all_gather_bytes, unit.all_gather_bytes());
    t.largest_all_gather_comm_bytes = std::max(t.largest_all_gather_comm_bytes, unit.all_gather_comm_bytes());
    if (is_root) {
      t.root_bytes = unit.gathered_capacity_bytes();
    } else {
      t.largest_unit_bytes = std::max(t.largest_unit_bytes, unit.gathered_capacity_bytes());
      t.all_units_bytes += unit.gathered_capacity_bytes();
      t.largest_unit_grad_bytes = std::max(t.largest_unit_grad_bytes, unsharded_grads);
    }
  }
  t.ahead = schedule_ ? schedule_->max_ahead() : 0;
  t.peak_param_bytes = parameter_peak(t.ahead);
  t.peak_grad_bytes = gradient_peak(micro_batches, accumulation);
  return t;
}

namespace {

// FSDP's measured memory beside its theory, as the facet every loop reads (standard_facets.h).
class FsdpMemory : public MemoryFacet {
 public:
  explicit FsdpMemory(FullyShardedModel& fsdp) : fsdp_(fsdp) {}
  void reset_memory_peaks() override { fsdp_.reset_memory_peaks(); }
  MemoryFigures memory_figures(int micro_batches, bool reduce_each_micro_batch) const override {
    const MemoryTheory t =
        fsdp_.memory_theory(micro_batches, reduce_each_micro_batch ? Accumulation::kReduce : Accumulation::kNoSync);
    const MemoryStats& m = fsdp_.memory();
    return {m.peak_param_bytes, t.peak_param_bytes, m.peak_grad_bytes, t.peak_grad_bytes};
  }
  void record_memory_samples(bool on) override { fsdp_.record_memory_samples(on); }
  std::vector<MemorySample> memory_samples() const override { return fsdp_.memory_samples(); }

 private:
  FullyShardedModel& fsdp_;
};

}  // namespace

void FullyShardedModel::offer_facets() {
  facets_.add<FullyShardedModel>(this);  // its units, mesh, schedule and pool, to whoever holds a facade
  auto memory = std::make_shared<FsdpMemory>(*this);
  facets_.add<MemoryFacet>(memory.get(), memory);
}

}  // namespace shardlab::fsdp
