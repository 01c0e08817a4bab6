#pragma once
/// @file standard_facets.h
/// The facets (facets.h) the core names, so that a training loop can use them whatever wrapper offers them:
///  - MemoryFacet: the bytes a wrapper held, measured, beside its theory (FSDP and HSDP);
///  - ReplicaSync: the switch for the all-reduce across replicas, for accumulation (the hybrid wrapper);
///  - StepSeam: work a wrapper does after the optimizer's step (a sharded optimizer's all-gather of its rows).
/// A loop asks `wrapper.facet<F>()` and skips what is null.

#include <cstdint>
#include <vector>

namespace shardlab {

/// The most bytes one rank held at once since MemoryFacet::reset_memory_peaks, by kind, beside the theory of the
/// step.
struct MemoryFigures {
  int64_t peak_param_bytes = 0;         ///< parameters: shards, gathered units, all-gather buffers
  int64_t peak_param_bytes_theory = 0;  ///< what theory says of them
  int64_t peak_grad_bytes = 0;          ///< gradients: shards, unsharded ones, accumulators, reduction buffers
  int64_t peak_grad_bytes_theory = 0;   ///< what theory says of them
};

/// What was held right after one allocation or free.
struct MemorySample {
  int64_t ns = 0;           ///< steady_clock time (now_ns)
  int64_t param_bytes = 0;  ///< parameter bytes held from then on
  int64_t grad_bytes = 0;   ///< gradient bytes held from then on
};

/// Facet: a wrapper that measures the memory it holds.
class MemoryFacet {
 public:
  virtual ~MemoryFacet() = default;
  /// Starts a new peak window at what is held now (call it at the start of a step).
  virtual void reset_memory_peaks() = 0;
  /// The peaks since the last reset beside the theory of a step of `micro_batches` micro-batches: with
  /// `reduce_each_micro_batch`, every micro-batch reduced (ReplicaSync off before the last); otherwise those before
  /// the last kept local (no_sync).
  virtual MemoryFigures memory_figures(int micro_batches, bool reduce_each_micro_batch) const = 0;
  /// Starts (or stops) keeping a MemorySample per allocation and free, for timelines.
  virtual void record_memory_samples(bool on) = 0;
  /// The samples kept so far, in time order.
  virtual std::vector<MemorySample> memory_samples() const = 0;
};

/// Facet: the all-reduce across replicas can be deferred, for accumulation (FSDP2's set_requires_all_reduce).
class ReplicaSync {
 public:
  virtual ~ReplicaSync() = default;
  /// False: the next backward passes reduce within each replica only and keep the result; true (the default): the
  /// next backward also all-reduces across replicas what was kept. Every rank alike, between backward passes.
  virtual void set_requires_all_reduce(bool requires_all_reduce) = 0;
};

/// Facet: the wrapper has work after the optimizer's step, before the next forward (a sharded optimizer
/// all-gathers the rows each rank stepped). A loop that builds the optimizer over parameters() calls it on every
/// rank right after `optimizer.step()`.
class StepSeam {
 public:
  virtual ~StepSeam() = default;
  /// Called once after every optimizer step, on every rank alike; may be a collective.
  virtual void after_optimizer_step() = 0;
};

}  // namespace shardlab
