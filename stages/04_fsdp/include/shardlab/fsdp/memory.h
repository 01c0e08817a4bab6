#pragma once
/// @file memory.h
/// Stage 04 — memory accounting: every buffer the FSDP layer allocates or frees is counted here, so the peak per
/// step is *measured* (what was really held), not computed from a formula. The formula (MemoryTheory) is printed
/// beside it.

#include <cstdint>

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

/// Counts allocations and frees. One per rank; used from the training (and backward) thread only.
class MemoryMeter {
 public:
  /// `bytes` more of `kind` are held.
  void allocate(MemoryKind kind, int64_t bytes);
  /// `bytes` of `kind` were freed. @throws std::logic_error when more is freed than is held (an accounting bug).
  void release(MemoryKind kind, int64_t bytes);
  /// The counters.
  const MemoryStats& stats() const { return stats_; }
  /// Starts a new peak window at what is held now.
  void reset_peaks();

 private:
  MemoryStats stats_;
};

}  // namespace shardlab::fsdp
