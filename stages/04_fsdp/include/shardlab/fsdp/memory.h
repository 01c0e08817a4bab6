#pragma once
/// @file memory.h
/// Stage 04 — memory accounting: the buffers the FSDP layer allocates and frees are counted here, so the peak per
/// step is *measured* (what was really held), not computed from a formula: the parameters' buffers by the allocator
/// that hands them out (CountingAllocator), the gradients at the events that make and free them. The formula
/// (MemoryTheory, in fsdp_memory.cpp) is printed beside it.

#include "shardlab/core/compat.h"  // SHARDLAB_ALLOCATE_CONST, SHARDLAB_ALLOCATOR_COPY_DATA
#include "shardlab/core/parallel/standard_facets.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace shardlab::fsdp {

/// What the bytes hold.
enum class MemoryKind {
  kParams,  ///< sharded parameters, gathered (unsharded) parameters, all-gather buffers
  kGrads,   ///< sharded gradients, unsharded gradients, accumulators, reduce-scatter buffers
};

/// Bytes held now and the most held since the last reset, per kind.
struct MemoryStats {
  int64_t param_bytes = 0;       ///< held now
  int64_t peak_param_bytes = 0;  ///< most held at once since the last reset_peaks()
  int64_t grad_bytes = 0;        ///< held now
  int64_t peak_grad_bytes = 0;   ///< most held at once since the last reset_peaks()
};

/// What was held right after one allocation or free (the core's, which MemoryFacet hands out).
using MemorySample = shardlab::MemorySample;

/// Counts allocations and frees, per kind: the parameters' buffers where they are allocated (CountingAllocator),
/// the gradients' at the unit's events (Note [Counting a unit's memory]). One per wrapper. Thread-safe: a block may
/// be freed on any thread, and after the meter is gone (it then counts into nothing the meter can read).
class MemoryMeter {
 public:
  MemoryMeter();
  MemoryMeter(const MemoryMeter&) = delete;  ///< one meter's counters, never shared by a copy
  MemoryMeter& operator=(const MemoryMeter&) = delete;
  /// Starts (or stops) keeping a MemorySample per allocation and free, for timelines (off by default; at most
  /// kMaxSamples are kept).
  void record_samples(bool on);
  /// The samples kept so far, in time order.
  std::vector<MemorySample> samples() const;
  /// Most samples kept.
  static constexpr size_t kMaxSamples = 1 << 20;
  /// `bytes` more of `kind` are held.
  void allocate(MemoryKind kind, int64_t bytes);
  /// `bytes` of `kind` were freed. @throws InternalError when more is freed than is held (an accounting bug).
  void release(MemoryKind kind, int64_t bytes);
  /// The counters, now.
  MemoryStats stats() const;
  /// Starts a new peak window at what is held now.
  void reset_peaks();

  struct State;  ///< the counters, shared with the blocks a CountingAllocator handed out (implementation detail)

 private:
  friend class CountingAllocator;
  std::shared_ptr<State> state_;
};

/// A c10::Allocator in front of another (a BufferPool, the CPU's or a device's allocator) that counts every block it
/// hands out in a MemoryMeter as `kind`, from its allocation to its free, whoever frees it: what a unit's buffers
/// hold is measured where it is allocated, not computed. A storage made from it keeps it as its allocator, so
/// regrow_storage is counted too, and free_storage releases the count at once (Note [Counting a unit's memory]).
/// It must outlive every storage that may still allocate through it (regrow); its blocks may outlive it.
class CountingAllocator final : public c10::Allocator {
 public:
  /// Counts `inner`'s blocks (never null; it must outlive this allocator's blocks) in `meter` as `kind`.
  CountingAllocator(c10::Allocator* inner, MemoryMeter& meter, MemoryKind kind);
  /// A block of `n` bytes from the inner allocator, counted until it is freed.
  c10::DataPtr allocate(size_t n) SHARDLAB_ALLOCATE_CONST override;
  SHARDLAB_ALLOCATOR_COPY_DATA
  /// An uninitialized contiguous tensor of `numel` elements of `dtype` on `device` (the inner allocator's), whose
  /// storage uses this allocator.
  at::Tensor empty(int64_t numel, c10::ScalarType dtype, c10::Device device);

 private:
  c10::Allocator* inner_;
  std::shared_ptr<MemoryMeter::State> state_;
  MemoryKind kind_;
};

}  // namespace shardlab::fsdp
