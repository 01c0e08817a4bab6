#pragma once
/// @file prefetch_policy.h
/// Stage 05 — what to prefetch, how deep, and how much may be in flight: one small struct, checked once.

#include <map>
#include <string>
#include <vector>

namespace shardlab::prefetch {

/// Which units' all-gathers are issued ahead of their use, and how many may be ahead at once.
///
/// "Ahead" means *prefetched and not yet used*: the unit's all-gather was issued by the schedule and the unit's own
/// pre-forward (or pre-backward) has not run yet. A unit that is used stops being ahead.
///
/// Defaults are FSDP2's on a GPU: one unit ahead in forward (the next unit's all-gather overlaps this unit's
/// forward) and one in backward (the unit whose backward comes next).
struct PrefetchPolicy {
  /// At a unit's pre-forward, prefetch the next `forward_depth` units of the expected forward order (the last
  /// forward's order; registration order, root first, before any forward ran). 0: no forward prefetch.
  int forward_depth = 1;
  /// At a unit's pre-backward, prefetch the next `backward_depth` units of the backward order (prefetch.h:
  /// backward_order). 0: no backward prefetch.
  int backward_depth = 1;
  /// At most this many units ahead at any moment, in forward and backward alike; a prefetch that would exceed it is
  /// skipped (the unit is then gathered at its own use, or prefetched at a later point). 0: the largest depth or
  /// list length below, so that what is asked for is never cut.
  int max_in_flight = 0;
  /// Explicit lists (FSDP2's set_modules_to_forward_prefetch): unit name -> the units, in order, to prefetch at
  /// that unit's pre-forward. A unit with a list ignores forward_depth. "root" names the root.
  std::map<std::string, std::vector<std::string>> forward_lists;
  /// Explicit lists at pre-backward (FSDP2's set_modules_to_backward_prefetch), as forward_lists.
  std::map<std::string, std::vector<std::string>> backward_lists;
};

/// The limit in force: `max_in_flight`, or when it is 0 the largest of the depths and list lengths (at least 1).
int in_flight_limit(const PrefetchPolicy& policy);

/// Checks a policy against the units it will schedule.
/// @param policy the policy to check.
/// @param units the unit names, in FullyShardedModel::units() order.
/// @throws std::invalid_argument naming the field, what was expected and what came: a negative depth or limit, a
///         name in a list that is not a unit (the known names are listed), a unit listed twice in one list or in
///         its own list, or a list longer than an explicit max_in_flight.
void validate(const PrefetchPolicy& policy, const std::vector<std::string>& units);

}  // namespace shardlab::prefetch
