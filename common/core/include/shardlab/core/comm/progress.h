#pragma once
/// @file progress.h
/// Progress points: where a compute thread gives its core to the threads that move this process's collectives.
/// See Note [Yielding to communication] in progress.cpp.
///
/// Vocabulary: a collective is *in flight* from its submission on CPU tensors until its backend reports it
/// complete (or failed). A *progress point* is a place in backward where the compute thread can pause for a moment
/// at no cost to correctness: after each gradient-ready callback (GradientReadiness calls progress_point()).
#include <atomic>
#include <cstdint>

namespace shardlab {

/// Whether progress points yield (process-wide; on by default). Off: progress_point() never yields.
void set_yield_to_communication(bool on);
/// The current setting of set_yield_to_communication.
bool yield_to_communication();

/// Collectives on CPU tensors submitted by any Communicator of this process and not yet complete (and Gloo barriers,
/// which have no tensor). Collectives of CUDA tensors (NCCL's, and Gloo's through host copies) are not counted: a
/// choice, since backward on a GPU leaves its CPU thread mostly idle.
int64_t collectives_in_flight();

/// Yields the calling thread's core (sched_yield) when yielding is on and a collective is in flight; returns whether
/// it yielded. Called at every gradient-ready point; cheap when nothing is in flight (two atomic loads).
bool progress_point();

/// How many times progress_point() has yielded in this process (for tests and reports).
uint64_t progress_yields();

namespace detail {
/// One collective of the count above: constructed when it is submitted (that counts it), end() when it completes
/// (or fails). end() is idempotent, so the backend's completion callback and the waiting thread may both call it;
/// the destructor ends it too, so a collective whose owner went away never stays counted.
class InFlight {
 public:
  /// Counts one more collective in flight.
  InFlight();
  /// Ends it, if end() has not.
  ~InFlight();
  /// Not copyable: one token per collective.
  InFlight(const InFlight&) = delete;
  /// Not copyable: one token per collective.
  InFlight& operator=(const InFlight&) = delete;
  /// Stops counting this collective (the first call; later calls do nothing). Thread-safe.
  void end();

 private:
  std::atomic<bool> ended_{false};
};
}  // namespace detail

}  // namespace shardlab
