#pragma once
/// @file memory.h
/// Stage 04 — memory accounting: every buffer the FSDP layer allocates or frees is counted here, so the peak per
/// step is *measured* (what was really held), not computed from a formula. The formula (MemoryTheory) is printed
/// beside it.

#include "shardlab/core/parallel/standard_facets.h"

#include <cstddef>
#include <cstdint>
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

/// Counts allocations and frees. One per rank; used from the training (and backward) thread only.
class MemoryMeter {
 public:
  /// Starts (or stops) keeping a MemorySample per allocation and free, for timelines (off by default; at most
  /// kMaxSamples are kept).
  void record_samples(bool on) { recording_ = on; }
  /// The samples kept so far, in time order.
  const std::vector<MemorySample>& samples() const { return samples_; }
  /// Most samples kept.
  static constexpr size_t kMaxSamples = 1 << 20;
  /// `bytes` more of `kind` are held.
  void allocate(MemoryKind kind, int64_t bytes);
  /// `bytes` of `kind` were freed. @throws InternalError when more is freed than is held (an accounting bug).
  void release(MemoryKind kind, int64_t bytes);
  /// The counters.
  const MemoryStats& stats() const { return stats_; }
  /// Starts a new peak window at what is held now.
  void reset_peaks();

 private:
  void sample();

  MemoryStats stats_;
  bool recording_ = false;
  std::vector<MemorySample> samples_;
};

}  // namespace shardlab::fsdp
