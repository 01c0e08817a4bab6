#pragma once
/// @file auto_caps.h
/// Stage 02 (given) — the cost model of cap_tuning.h put to work during training: once the buckets have been rebuilt
/// from a real backward, measure the group's all-reduce, choose both caps from the last backward's ready times, and
/// lay the buckets out again with them. What `shardlab train --bucket-cap-kb auto` and parallelize's
/// `BucketPolicy::auto_caps` do.

#include "shardlab/bucketed_ddp/bucketed_ddp.h"
#include "shardlab/bucketed_ddp/cap_tuning.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/parallel/standard_facets.h"

#include <cstddef>
#include <optional>
#include <utility>

namespace shardlab::bucketed_ddp {

/// What AutoCaps chose, and from what.
struct CapChoice {
  BucketCaps before;                ///< the caps in use when it chose
  BucketCaps chosen;                ///< rank 0's choice, which every rank took
  LinkCost cost;                    ///< the group's all-reduce, measured (every rank the same figures)
  double exposed_before_ns = 0;     ///< the model's exposed communication of `profile` with `before`
  double exposed_chosen_ns = 0;     ///< the same with `chosen`
  BackwardProfile profile;          ///< the backward it chose from (this rank's)
  std::pair<size_t, size_t> setup;  ///< recorder indices [first, last) of the measurement's collectives: setup, not
                                    ///< training traffic
};

/// A StepSeam (standard_facets.h) that tunes a BucketedDDP's caps once: after the first step whose backward ran on
/// rebuilt buckets (the second step of a fresh run: the first warm backward, laid out in the real ready order), it
/// measures the all-reduce on `comm` (measure_all_reduce_cost), lets choose_caps pick both caps from that backward's
/// profile, broadcasts rank 0's choice (ranks saw different ready times) and calls set_caps with it. Caps that
/// set_caps already chose (BucketedDDP::caps_set: a run resumed from a checkpoint of a tuned run) are kept, so a run
/// resumed from a checkpoint of a run with AutoCaps tunes at the step the uninterrupted one did (after the first
/// resumed step when it was saved before tuning). A collective at that one step; every rank of `comm`
/// calls after_optimizer_step alike. `ddp` and `comm` (the group `ddp` reduces over) must outlive it.
class AutoCaps : public StepSeam {
 public:
  /// Tunes `ddp`, which reduces over `comm`; both must outlive it.
  AutoCaps(BucketedDDP& ddp, Communicator& comm) : ddp_(ddp), comm_(comm) {}
  /// After the first step whose backward ran on rebuilt buckets (BucketedDDP::rebuilt), tunes once (a collective),
  /// unless set_caps already chose the caps; otherwise nothing. Every rank alike, after every optimizer step.
  void after_optimizer_step() override;
  /// The choice, once made; empty before, and for caps set_caps had already chosen.
  const std::optional<CapChoice>& choice() const { return choice_; }

 private:
  BucketedDDP& ddp_;
  Communicator& comm_;
  std::optional<CapChoice> choice_;
};

}  // namespace shardlab::bucketed_ddp
