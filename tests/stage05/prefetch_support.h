#pragma once
// What stage 05's tests share besides the chain (support/chain.h): an event log of the units as "U name" (a real
// begin_unshard) and "R name" (a real reshard).
#include "shardlab/fsdp/fsdp.h"

#include "support/chain.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::test_support {

/// Every real begin_unshard ("U name") and reshard ("R name") of `fsdp`'s units from now on; `take()` starts a new
/// phase (forward, backward) so each can be compared on its own.
class UnitLog {
 public:
  explicit UnitLog(fsdp::FullyShardedModel& fsdp) : fsdp_(fsdp) {
    fsdp.set_observer([this](const fsdp::UnitEvent& e) {
      events_.push_back(e);
      if (e.kind == fsdp::UnitEventKind::kBeginUnshard || e.kind == fsdp::UnitEventKind::kReshard)
        current_.push_back(std::string(e.kind == fsdp::UnitEventKind::kBeginUnshard ? "U " : "R ") +
                           fsdp_.units()[e.unit]->name());
      if (on_event) on_event(e);
    });
  }
  ~UnitLog() { fsdp_.set_observer({}); }
  UnitLog(const UnitLog&) = delete;
  UnitLog& operator=(const UnitLog&) = delete;
  /// The U/R sequence since the last take(), and starts a new one.
  std::vector<std::string> take() { return std::exchange(current_, {}); }
  /// Every event so far.
  const std::vector<fsdp::UnitEvent>& events() const { return events_; }
  /// Called after each event is logged.
  std::function<void(const fsdp::UnitEvent&)> on_event;

 private:
  fsdp::FullyShardedModel& fsdp_;
  std::vector<fsdp::UnitEvent> events_;
  std::vector<std::string> current_;
};

}  // namespace shardlab::test_support
