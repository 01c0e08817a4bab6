#include "shardlab/prefetch/prefetch.h"

#include "shardlab/core/errors.h"

#include <algorithm>
#include <string>

// Note [When backward meets a unit]
// A unit's pre-backward hook sits on its output (stage 04's post_forward registers it), so it fires when the
// gradient of that output is ready: autograd walks the graph from the loss back to the inputs, and an output made
// later is reached earlier. A unit's forward may enclose others: the root's forward is the whole loss(), so it
// begins first but its output (the loss) is made last, and its hook is the first of the backward. The schedule
// needs this order before backward starts (to prefetch the first units' all-gathers), and it must be the same on
// every rank, so it is derived from what the forward recorded, never by walking the graph. A unit whose output needs
// no gradient (frozen, on inputs that need none) registered no hook and is never met in backward
// (FullyShardedModel::awaits_backward): a prefetch of it would be an all-gather stage 04 never makes.
//
// Note [Prefetching only what every rank prefetches]
// A prefetch is an all-gather: every rank of the group must issue it, in the same place of its sequence of
// collectives (Gloo pairs them by order). The schedule decides from the orders (the same on every rank: every
// rank runs the same units in the same order), the units' states (the same: each state changes only at the same
// points of the same program) and the policy (the same). It never asks "has that all-gather finished?": a test
// of timing would differ between ranks, and two ranks that prefetch differently hang or mix up their collectives.
//
// Note [The limit on what is ahead]
// A unit ahead holds its all-gather buffer from its prefetch to its use. Unlimited, a deep prefetch would gather
// most of the model before it is needed: the memory FSDP exists to save. The schedule counts the units ahead and
// skips a prefetch that would exceed the limit; nothing blocks (FSDP1's limit_all_gathers blocked the CPU; FSDP2
// has no limit and relies on the caching allocator). A skipped unit is not lost: the next point prefetches it if
// there is room then, and its own pre-forward gathers it otherwise. memory_theory() counts one all-gather buffer
// per unit the limit allows ahead.

namespace shardlab::prefetch {

using fsdp::FullyShardedModel;
using fsdp::SchedulePoint;

std::vector<size_t> backward_order(const FullyShardedModel& fsdp) {
  // TODO(stage05): the order the pre-backward hooks fire in (Note [When backward meets a unit])
  throw ::shardlab::NotImplemented("05", "the order the pre-backward hooks fire in (Note [When backward meets a unit])");
}

PrefetchSchedule::PrefetchSchedule(const FullyShardedModel& fsdp, PrefetchPolicy policy)
    : policy_(std::move(policy)), limit_(in_flight_limit(policy_)) {
  // With depths only, in the steady state (the forward runs in the expected order), what is ahead at unit u lies
  // among the next `depth` units after it: no more than the depth is ahead. Explicit lists may name units far
  // ahead, and units listed by several points pile up: only the limit bounds them. (A forward out of its expected
  // order may hold one more for a while: Note [The parameter peak, walked].)
  const bool lists = !policy_.forward_lists.empty() || !policy_.backward_lists.empty();
  max_ahead_ = lists ? limit_ : std::min(limit_, std::max(policy_.forward_depth, policy_.backward_depth));
  const auto& units = fsdp.units();
  std::vector<std::string> names;
  names.reserve(units.size());
  for (const auto& unit : units) names.push_back(unit->name());
  validate(policy_, names);
  auto index_of = [&](const std::string& name) {
    return static_cast<size_t>(std::find(names.begin(), names.end(), name) - names.begin());
  };
  forward_lists_.resize(units.size());
  backward_lists_.resize(units.size());
  has_forward_list_.assign(units.size(), false);
  has_backward_list_.assign(units.size(), false);
  for (const auto& [owner, list] : policy_.forward_lists) {
    has_forward_list_[index_of(owner)] = true;
    for (const auto& name : list) forward_lists_[index_of(owner)].push_back(index_of(name));
  }
  for (const auto& [owner, list] : policy_.backward_lists) {
    has_backward_list_[index_of(owner)] = true;
    for (const auto& name : list) backward_lists_[index_of(owner)].push_back(index_of(name));
  }
  // TODO(stage05): the iteration state, sized for the units
}

void PrefetchSchedule::begin_iteration(FullyShardedModel& /*fsdp*/) {
  // TODO(stage05): a new iteration: nothing ahead, nothing used (FSDP sharded every unit)
}

std::vector<size_t> PrefetchSchedule::ahead() const {
  // TODO(stage05): the units ahead, in the order they were prefetched
  throw ::shardlab::NotImplemented("05", "the units ahead, in the order they were prefetched");
}

std::vector<size_t> PrefetchSchedule::targets(SchedulePoint point, size_t u, const FullyShardedModel& fsdp) const {
  if (point == SchedulePoint::kPostForward || u >= forward_lists_.size()) return {};
  const bool forward = point == SchedulePoint::kPreForward;
  // TODO(stage05): the unit's explicit list, else the next depth units after it in this point's order
  throw ::shardlab::NotImplemented("05", "the unit's explicit list, else the next depth units after it in this point's order");
}

void PrefetchSchedule::at(SchedulePoint point, size_t u, FullyShardedModel& fsdp) {
  if (point == SchedulePoint::kPostForward) return;
  // TODO(stage05): u is used now; prefetch its targets, skipping no-ops, within the limit (Note [The limit ...])
  throw ::shardlab::NotImplemented("05", "u is used now; prefetch its targets, skipping no-ops, within the limit (Note [The limit ...])");
}

void PrefetchSchedule::end_forward(FullyShardedModel& fsdp) {
  // TODO(stage05): what is still ahead was not run by this forward and will not run in its backward: cancel it
  throw ::shardlab::NotImplemented("05", "what is still ahead was not run by this forward and will not run in its backward: cancel it");
}

std::shared_ptr<PrefetchSchedule> enable_prefetch(FullyShardedModel& fsdp, PrefetchPolicy policy) {
  auto schedule = std::make_shared<PrefetchSchedule>(fsdp, std::move(policy));
  fsdp.set_schedule(schedule);
  return schedule;
}

}  // namespace shardlab::prefetch
