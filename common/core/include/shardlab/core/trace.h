#pragma once
/// @file trace.h
/// One rank's timeline as a Chrome trace (JSON; opens in chrome://tracing and https://ui.perfetto.dev).
///
/// Tracks (Chrome "threads") of process `rank`:
///  - tid 1 "compute": the spans the training loop records (forward, backward, optimizer), with the waits for
///    communication (WaitRecord) nested inside them — a wait is communication that nothing hid.
///  - tid 2, 3, … "comm k": every collective from the CommRecorder, from submission to completion. Collectives that
///    overlap in time go to different lanes, so each lane's spans never overlap.
///  - counter tracks ("ph": "C"): values over time, e.g. the bytes FSDP holds (one series per kind).
/// Timestamps are steady-clock microseconds, the same clock in every process of one machine, so the files of all
/// ranks line up when loaded together.

#include "shardlab/core/comm/comm_record.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

/// A span of compute time on the training thread.
struct TraceSpan {
  std::string name;      ///< e.g. "forward", "backward", "optimizer"
  int64_t start_ns = 0;  ///< steady_clock (now_ns) start
  int64_t end_ns = 0;    ///< steady_clock end
  int step = -1;         ///< training step it belongs to (-1: none), written into the span's args
};

/// One point of a counter track: from `ns` on, each series of `track` has the value given (until the next point).
struct CounterSample {
  std::string track;                                   ///< the counter's name, e.g. "memory"
  int64_t ns = 0;                                      ///< steady_clock (now_ns) time
  std::vector<std::pair<std::string, double>> series;  ///< e.g. {{"param_bytes", 1024}, {"grad_bytes", 0}}
};

/// Collects the compute spans of one rank, in the order they end.
class Timeline {
 public:
  /// Appends a finished span.
  void add(TraceSpan span) { spans_.push_back(std::move(span)); }
  /// Every span so far.
  const std::vector<TraceSpan>& spans() const { return spans_; }

  /// RAII: records [construction, destruction) as a span named `name` into `timeline` (no-op when null).
  class Scope {
   public:
    /// Starts the span now.
    Scope(Timeline* timeline, std::string name, int step);
    /// Ends the span now and adds it.
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Timeline* timeline_;
    TraceSpan span_;
  };

 private:
  std::vector<TraceSpan> spans_;
};

/// Writes one rank's Chrome trace (written beside `path`, then renamed: never half a file).
/// @param path the file to write, e.g. "traces/rank0.trace.json".
/// @param rank becomes the trace's process id and name ("rank r").
/// @param compute spans of the training thread.
/// @param collectives every collective to show (e.g. CommRecorder::snapshot()); pending ones (end 0) are skipped.
/// @param waits the waits for communication (CommRecorder::waits()).
/// @param counters counter samples, in time order (may be empty).
/// @throws std::runtime_error when the file cannot be written.
void write_chrome_trace(const std::string& path, int rank, const std::vector<TraceSpan>& compute,
                        const std::vector<CollectiveRecord>& collectives, const std::vector<WaitRecord>& waits,
                        const std::vector<CounterSample>& counters = {});

}  // namespace shardlab
