#pragma once
/// @file reduce_scatter_bucketer.h
/// Stage 03 — bucketing many small reduce-scatters into few large ones, asynchronously.
///
/// FSDP reduce-scatters one gradient per wrapped unit; with many small units every collective pays its fixed
/// latency. The bucketer copies small inputs side by side into one buffer per (dtype, device, group) and sends
/// the buffer as one reduce-scatter; each caller gets its own part of the result through a callback.
///
/// Vocabulary:
///  - *input*: `W * n` elements (W = comm.size()); rank r's chunk is elements [r*n, (r+1)*n). Its *shard* is n.
///  - *bucket*: a buffer of W rows of `shard capacity` elements, capacity = cap_bytes / element_size / W. An input
///    is copied into column range [offset, offset + n) of every row, so row r holds every input's chunk r side by
///    side and a reduce-scatter of the rows leaves, on rank r, every input's reduced chunk r side by side.
///  - *large input*: one whose shard exceeds the shard capacity; it is sent at once, on its own.
///  - *in flight*: a collective launched and not yet waited for. A bucket that cannot take the next input is
///    launched at once (before the input goes into a fresh or recycled buffer), so nothing waits; a bucket that
///    is merely full waits for the next input or flush(); everything is waited for in flush().
///
/// References: fairscale's ReduceScatterBucketer (fairscale/internal/reduce_scatter_bucketer.py), which is
/// synchronous; here every launch is asynchronous and callbacks run in flush().

#include "shardlab/core/comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace shardlab::comm_hooks {

/// fairscale's ReduceScatterBucketer, asynchronous: buckets small reduce-scatters (SUM) into large ones.
///
/// Contract:
///  - Every rank of a group must make the same calls in the same order, with inputs of the same sizes and dtypes
///    (the buckets, hence the collectives, then match across ranks).
///  - Callbacks run only inside flush(), on the thread calling it, never on the backend's thread.
///  - Not thread-safe: use one bucketer from one thread (the rank's training thread).
///  - Every Communicator passed in must outlive the bucketer's pending work (flush() before destroying either).
class ReduceScatterBucketer {
 public:
  /// Receives this rank's reduced (SUM) chunk of an input: a 1-D tensor of n elements in the input's dtype. It is
  /// a view into a bucket buffer, valid during the callback only: copy what you keep.
  using Callback = std::function<void(const at::Tensor& reduced_chunk)>;

  /// @param bucket_cap_bytes size of one bucket over all ranks' rows (default 25 MiB); <= 0 disables bucketing:
  ///        every input is then sent at once on its own.
  explicit ReduceScatterBucketer(int64_t bucket_cap_bytes = 25 << 20);
  /// Waits for collectives still in flight (they write into buffers owned here) without running their callbacks.
  /// Call flush() first: a destructor cannot report an error.
  ~ReduceScatterBucketer();
  ReduceScatterBucketer(const ReduceScatterBucketer&) = delete;
  ReduceScatterBucketer& operator=(const ReduceScatterBucketer&) = delete;

  /// Queues a reduce-scatter (SUM) of `input` over `comm`; `callback` (may be null) receives this rank's reduced
  /// chunk in flush(). A small input is copied into the open bucket of (dtype, device, comm) at once, launching
  /// that bucket first if the input does not fit in what is left of it; a large input is launched at once on its
  /// own (the input is then read by the backend while in flight: keep it unchanged until flush() returns).
  /// @pre input is defined, dense, of a floating or integral (non-bool) dtype, with a multiple of comm.size()
  ///      elements.
  /// @throws std::invalid_argument naming what was expected and what came.
  void reduce_scatter_async(const at::Tensor& input, Communicator& comm, Callback callback);

  /// Launches every partial bucket, waits for every collective in flight in launch order, runs the callbacks (in
  /// launch order; within a bucket in submission order) and empties the buckets. Buffers are kept for reuse.
  /// A collective must be launched on every rank: call flush() on all ranks at the same point.
  /// @throws std::runtime_error from a failed collective (the remaining work is still waited for and dropped).
  void flush();

  /// Frees every bucket buffer: their storages get 0 bytes (buffers grow again on the next use).
  /// @throws std::logic_error when anything is pending (queued callbacks or collectives in flight): flush() first.
  void teardown();

  /// The cap given at construction, in bytes.
  int64_t bucket_cap_bytes() const { return cap_bytes_; }
  /// Elements one rank's row of a bucket holds for `dtype` on `world_size` ranks (0 when bucketing is off).
  int64_t shard_capacity(c10::ScalarType dtype, int world_size) const;
  /// Callbacks queued and not yet run (in open buckets or in flight).
  size_t pending_callbacks() const;
  /// Collectives launched and not yet waited for.
  size_t in_flight() const { return in_flight_.size(); }
  /// Number of (dtype, device, group) buckets created so far.
  size_t num_buckets() const { return buckets_.size(); }
  /// Every buffer held (open and spare bucket buffers, buffers in flight, large-input outputs in flight): for
  /// tests that check storage is freed.
  std::vector<at::Tensor> buffers() const;
  /// Sum of the storage bytes of buffers().
  int64_t allocated_bytes() const;

 private:
  // One queued callback: its chunk is elements [offset, offset + numel) of the launched output.
  struct Pending {
    int64_t offset = 0;
    int64_t numel = 0;
    Callback callback;
  };
  // A bucket's storage: `data` [W, capacity] (row r = chunks r of its inputs), `output` [capacity].
  struct Buffer {
    at::Tensor data;
    at::Tensor output;
  };
  // The open bucket of one (dtype, device, group).
  struct Bucket {
    c10::ScalarType dtype;
    c10::Device device;
    Communicator* comm;
    int64_t capacity;             // elements per row
    Buffer open;                  // receives inputs; undefined tensors until first use (or after teardown)
    int64_t offset = 0;           // elements used in each row of `open`
    std::vector<Pending> queued;  // callbacks of the inputs in `open`, submission order
    std::vector<Buffer> spare;    // buffers back from flush(), reused before allocating
  };
  // A launched collective: its handle, what it writes to (kept alive) and the callbacks to run after it.
  struct InFlight {
    Handle handle;
    Buffer buffer;      // bucket buffer to recycle (undefined data for a large input)
    size_t bucket = 0;  // index into buckets_ when buffer.data is defined
    at::Tensor input;   // the packed or large input, kept alive while in flight
    at::Tensor output;  // the reduced chunks, Pending offsets index into it
    std::vector<Pending> callbacks;
  };

  Bucket& bucket_for(const at::Tensor& input, Communicator& comm, size_t* index);
  void ensure_open(Bucket& bucket);
  void launch(size_t bucket_index);
  void launch_large(const at::Tensor& input, int64_t shard, Communicator& comm, Callback callback);

  int64_t cap_bytes_;
  std::vector<Bucket> buckets_;      // creation order (identical on every rank), so flush() launches in order
  std::vector<InFlight> in_flight_;  // launch order
};

}  // namespace shardlab::comm_hooks
