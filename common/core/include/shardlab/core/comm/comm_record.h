#pragma once
/// @file comm_record.h
/// A record of every collective a Communicator submits: what the caller asked for and what really went on the
/// wire. Tests assert structure with it (how many collectives, of what size, in what order); the shardlab tool
/// computes bytes per step and overlap from it.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

/// One collective as seen by shardlab.
///
/// `op` is the operation the caller asked for; `wire_op`, `wire_dtype` and `bytes` describe what was really sent
/// (they differ when a fallback was used: e.g. reduce_scatter on Gloo 1.13 runs as an all_reduce of the whole
/// input, bf16 is sent as f32).
struct CollectiveRecord {
  std::string op;              ///< requested: all_reduce, broadcast, all_gather, reduce_scatter
  std::string wire_op;         ///< what the backend executed (equal to op unless a fallback was used)
  c10::ScalarType dtype;       ///< dtype of the caller's tensor
  c10::ScalarType wire_dtype;  ///< dtype that went on the wire
  int64_t numel = 0;           ///< elements of the caller's input tensor
  int64_t bytes = 0;           ///< bytes of the tensor handed to the backend by this rank (wire payload)
  std::string group;           ///< name of the Communicator (process group) it ran on
  int group_size = 0;          ///< number of ranks of that group (what the ring's (N-1)/N counts with)
  std::string reduce;          ///< "sum", "avg", "max" or "" for non-reductions
  int64_t start_ns = 0;        ///< steady_clock time of submission
  int64_t end_ns = 0;          ///< steady_clock time of completion (0 while pending); for CUDA tensors, when
                               ///< wait() had synchronized with it (the host cannot see the GPU finish earlier)
};

/// A span during which a rank's compute thread was blocked waiting for communication (e.g. the end-of-backward
/// wait of a DDP wrapper). Communication inside such a span is *exposed*: nothing else ran meanwhile.
struct WaitRecord {
  std::string what;      ///< who waited, e.g. "ddp sync"
  int64_t start_ns = 0;  ///< steady_clock time the wait began
  int64_t end_ns = 0;    ///< steady_clock time it returned
};

/// Thread-safe append-only log of collectives (and of the waits for them). Shared by all Communicators of one rank.
class CommRecorder {
 public:
  /// Appends `r` and returns its index, to be passed to `finish`.
  size_t begin(CollectiveRecord r);
  /// Sets the end time of record `index` to now (first call wins; later calls are ignored).
  void finish(size_t index);
  /// Returns a copy of all records, in submission order.
  std::vector<CollectiveRecord> snapshot() const;
  /// Returns the records submitted at or after index `from`.
  std::vector<CollectiveRecord> since(size_t from) const;
  /// Number of records so far (use as a marker for `since`).
  size_t size() const;

  /// Appends a wait span (see WaitRecord).
  void record_wait(std::string what, int64_t start_ns, int64_t end_ns);
  /// Marks [start_ns, end_ns) as work the waiting thread did inside one of its wait spans (stage 03's optimizer
  /// step, run in a handle's continuation while later collectives are in flight): it was not waiting then.
  void record_busy(int64_t start_ns, int64_t end_ns);
  /// The wait spans in the order they were recorded, each with the busy spans cut out of it (so a span may come
  /// back in several pieces, and one that was all work not at all).
  std::vector<WaitRecord> waits() const;

 private:
  mutable std::mutex mu_;
  std::vector<CollectiveRecord> records_;
  std::vector<WaitRecord> waits_;
  std::vector<std::pair<int64_t, int64_t>> busy_;
};

/// Nanoseconds on the steady clock, the time base of CollectiveRecord.
int64_t now_ns();

/// How much of a window communication took, and how much of that nothing hid.
struct CommTime {
  int64_t busy_ns = 0;     ///< time at least one collective was in flight (union of their spans)
  int64_t exposed_ns = 0;  ///< part of busy_ns during which the training thread waited (inside a WaitRecord)
};

/// Measures communication inside the window [from_ns, to_ns): spans are clipped to it; pending collectives
/// (end 0) are ignored.
CommTime comm_time(const std::vector<CollectiveRecord>& records, const std::vector<WaitRecord>& waits, int64_t from_ns,
                   int64_t to_ns);

}  // namespace shardlab
