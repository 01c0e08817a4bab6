#pragma once
/// @file stream.h
/// Streams and events for whatever device the tensors are on, as no-ops on CPU.
///
/// On CUDA, work is queued on streams and runs asynchronously to the host; overlapping communication with compute
/// (stage 05's prefetch) means issuing work on a side stream and ordering the streams with events. On CPU every
/// operation has finished when it returns, so there is nothing to order; but c10 throws there
/// (`c10::Event::record`: "cpu backend doesn't support events"). These classes let one code path serve both:
/// on CPU each call does nothing, on CUDA (or any device with a c10 guard implementation) it is the real thing.
///
/// They are device-generic (c10's virtual guard), so nothing here needs CUDA headers: a CPU-only libtorch builds
/// them unchanged.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace shardlab {

class Event;

/// One queue of work on one device. Cheap to copy (a device plus an id).
class Stream {
 public:
  /// The stream that work on `device` is issued to right now (on CPU: the device's only, no-op stream).
  static Stream current(c10::Device device);
  /// A stream from `device`'s pool, so work issued to it can overlap the current stream. On CPU it is the current
  /// stream (everything runs in program order anyway).
  static Stream side(c10::Device device, bool high_priority = false);

  /// The device this stream belongs to.
  c10::Device device() const { return stream_.device(); }
  /// True when stream operations do nothing (CPU).
  bool is_noop() const { return stream_.device_type() == c10::DeviceType::CPU; }
  /// Work issued to this stream after the call waits until `event`'s recorded work is done. Does not block the
  /// host. A no-op on CPU, or when `event` was never recorded.
  void wait(const Event& event) const;
  /// Work issued to this stream after the call waits for all work issued to `other` so far.
  void wait(const Stream& other) const;
  /// Blocks the host until all work issued to this stream has finished (a no-op on CPU).
  void synchronize() const;
  /// The c10 stream, for APIs that take one.
  const c10::Stream& raw() const { return stream_; }

  /// Same device and same stream.
  friend bool operator==(const Stream& a, const Stream& b) { return a.stream_ == b.stream_; }
  /// Not the same stream.
  friend bool operator!=(const Stream& a, const Stream& b) { return !(a == b); }

 private:
  explicit Stream(c10::Stream stream) : stream_(stream) {}
  c10::Stream stream_;
};

/// A marker in a stream: records "all work issued so far" so another stream (or the host) can wait for it.
/// Move-only. On CPU it holds nothing and is always complete.
class Event {
 public:
  /// An event for streams of `device`'s type.
  explicit Event(c10::Device device);
  /// Takes over `other`'s recorded point.
  Event(Event&& other) = default;
  /// Takes over `other`'s recorded point (this event's is dropped).
  Event& operator=(Event&& other) = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() = default;

  /// Marks the point after all work issued to `stream` so far; re-recording moves the mark.
  /// @throws std::invalid_argument if `stream` is on another device type than the event.
  void record(const Stream& stream);
  /// True when the recorded work has finished, or nothing was recorded, or on CPU. Does not block.
  bool query() const;
  /// True once record() has been called on a non-CPU device.
  bool recorded() const { return event_.has_value() && event_->was_marked_for_recording(); }

 private:
  friend class Stream;
  c10::DeviceType type_;
  std::optional<c10::Event> event_;  // empty on CPU
};

/// While alive, work on `stream`'s device is issued to `stream`; the previous stream (and device) come back when
/// it is destroyed. A no-op on CPU.
class StreamGuard {
 public:
  /// Makes `stream` (and its device) current until the guard is destroyed.
  explicit StreamGuard(const Stream& stream);
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;
  ~StreamGuard() = default;

 private:
  c10::OptionalStreamGuard guard_;
};

/// Tells `t`'s caching allocator that `stream` uses `t`, so its memory is not handed out again before the work
/// issued to `stream` so far has finished (needed when a tensor made on one stream is freed while another stream
/// still reads it). A no-op on CPU and for undefined tensors.
void record_stream(const at::Tensor& t, const Stream& stream);

}  // namespace shardlab
