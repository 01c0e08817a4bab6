#pragma once
/// @file prefetch.h
/// Stage 05 — prefetch: the next unit's all-gather is in flight while this unit computes, in forward and in
/// backward, with a limit on what is ahead, so that FSDP's communication hides behind its compute as DDP's does.
///
/// Vocabulary:
///  - *ahead*: a unit whose all-gather the schedule issued and whose own use (pre-forward, pre-backward) has not
///    come yet. It holds its all-gather buffer (not yet its gathered buffer: Note [Two buffers per unit]).
///  - *expected forward order*: stage 04's FullyShardedModel::expected_forward_order (the order the last forward
///    met the units in, or registration order, root first, before any forward ran).
///  - *backward order*: the order backward meets the units' pre-backward hooks (Note [When backward meets a unit]
///    in prefetch.cpp). The root's hook is on the loss, so the root comes first.
///
/// A PrefetchSchedule plugs into stage 04's extension point (fsdp::UnshardSchedule): FullyShardedModel calls it at
/// each unit's pre-forward, post-forward and pre-backward, and it calls `FullyShardedModel::begin_unshard` for the
/// units it prefetches. Nothing else in FSDP changes: the collectives of a step are the same, in number and
/// size, only issued earlier, so prefetch changes no bit of the result.
///
/// References: PyTorch FSDP2's implicit forward prefetch and `set_modules_to_forward_prefetch` /
/// `set_modules_to_backward_prefetch`; FSDP1's `limit_all_gathers`; the seed's FSDP homework, tasks 2 and 3.

#include "shardlab/fsdp/fsdp.h"
#include "shardlab/prefetch/prefetch_policy.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace shardlab::prefetch {

/// The order in which this backward will meet the units' pre-backward hooks, for any model (blocks run in any
/// order, units inside others), derived from what the forward recorded (FullyShardedModel's orders), without the
/// units that registered no hook (awaits_backward false: a prefetch of one would be a collective stage 04 never
/// makes). Valid once the forward returned.
std::vector<size_t> backward_order(const fsdp::FullyShardedModel& fsdp);

/// Issues all-gathers ahead of use, as a PrefetchPolicy says; FullyShardedModel's UnshardSchedule.
///
/// Contract:
///  - At a unit's pre-forward (pre-backward), the unit stops being ahead, then the targets() of that point are
///    prefetched in order: a target already gathered or in flight, or already used in this forward (backward), or
///    (in backward) one that backward will not meet (awaits_backward false, named by an explicit list), is
///    skipped as a no-op; a target that would put more than in_flight_limit(policy) units ahead is skipped.
///  - Post-forward prefetches nothing. At the end of the forward, a unit still ahead from a forward prefetch was
///    not run by this forward (the expected order was wrong: the model skipped it); it will not run in this
///    backward either, so its unshard is cancelled (FullyShardedModel::cancel_unshard) and it is no longer ahead:
///    its buffer neither lingers nor holds a place under the limit that backward's prefetches need.
///  - A new iteration (`loss()`) forgets what was ahead: FSDP has sharded every unit by then.
///  - Deterministic: the same orders and states give the same prefetches on every rank.
class PrefetchSchedule : public fsdp::UnshardSchedule {
 public:
  /// A schedule for `fsdp`'s units. @throws std::invalid_argument as validate(policy, unit names).
  PrefetchSchedule(const fsdp::FullyShardedModel& fsdp, PrefetchPolicy policy);

  /// Forgets what was ahead and what was used.
  void begin_iteration(fsdp::FullyShardedModel& fsdp) override;
  /// Marks `u` used and prefetches what the policy asks for at this point (see the contract).
  void at(fsdp::SchedulePoint point, size_t u, fsdp::FullyShardedModel& fsdp) override;
  /// Cancels the forward prefetches that were not used (see the contract).
  void end_forward(fsdp::FullyShardedModel& fsdp) override;
  /// The most units this schedule holds ahead in the steady state: in_flight_limit(policy()) with explicit lists;
  /// with depths only, no more than the larger depth (0 when both are 0).
  int max_ahead() const override;

  /// The units to prefetch at `point` of unit `u`, in order, before any is skipped: the unit's explicit list when
  /// the policy has one, else the next depth units after `u` in the expected forward order (kPreForward) or the
  /// backward order (kPreBackward); none at kPostForward or for a unit that is not in the order.
  std::vector<size_t> targets(fsdp::SchedulePoint point, size_t u, const fsdp::FullyShardedModel& fsdp) const;

  /// The policy in force.
  const PrefetchPolicy& policy() const;
  /// The units ahead now, in the order they were prefetched.
  std::vector<size_t> ahead() const;
  /// Prefetches issued so far (no-ops not counted).
  uint64_t issued() const;
  /// Prefetches skipped so far because the limit was reached.
  uint64_t skipped_for_limit() const;
  /// Prefetches cancelled so far at the end of a forward that did not use them.
  uint64_t cancelled() const;

 private:
  // Your state: the open track gives none of the solution's members.
};

/// Makes a PrefetchSchedule for `fsdp` and plugs it in (FullyShardedModel::set_schedule); returns it, for its
/// counters. Call on every rank alike, between steps. @throws std::invalid_argument as validate().
std::shared_ptr<PrefetchSchedule> enable_prefetch(fsdp::FullyShardedModel& fsdp, PrefetchPolicy policy = {});

}  // namespace shardlab::prefetch
