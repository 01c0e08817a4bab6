#pragma once
/// @file buffer_pool.h
/// A pool of host buffers that are reused rather than given back to malloc: what the CUDA caching allocator does
/// for FSDP on GPUs, for the CPU. See Note [Why FSDP pools its buffers] in buffer_pool.cpp.

#include "shardlab/core/compat.h"  // SHARDLAB_ALLOCATE_CONST, SHARDLAB_ALLOCATOR_COPY_DATA

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>
#include <memory>

namespace shardlab {

/// What a BufferPool holds.
struct PoolStats {
  int64_t in_use_bytes = 0;         ///< bytes of blocks handed out and not yet freed
  int64_t cached_bytes = 0;         ///< bytes of freed blocks kept for reuse
  int64_t peak_reserved_bytes = 0;  ///< the most in_use + cached ever held: what the process pays for the pool
  int64_t system_allocations = 0;   ///< blocks asked of the system allocator (the rest were reused)
  int64_t reuses = 0;               ///< requests served from the cache
};

/// A c10::Allocator for CPU tensors that keeps every block it hands out: when a tensor's storage lets go of one
/// (the tensor dies, or free_storage), the block goes back to the pool, and a later request for as many bytes, or
/// a few more, takes it again instead of asking malloc. Tensors made by `empty()` keep the pool as their storage's
/// allocator, so regrow_storage draws from it too.
///
/// Contract: thread-safe (blocks may be freed on any thread). The pool's state lives as long as the last block it
/// handed out: tensors may outlive the BufferPool object. It never gives cached memory back by itself; `trim()`
/// does. CPU only.
class BufferPool final : public c10::Allocator {
 public:
  /// A pool over `system` (the CPU allocator in force when null). Requests below `min_bytes` are not pooled: they
  /// go to `system` and back to it.
  explicit BufferPool(c10::Allocator* system = nullptr, size_t min_bytes = 0);
  ~BufferPool() override;
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// A block of at least `n` bytes: a cached one when one fits (its size in [n, n + n/8]), else a new one.
  c10::DataPtr allocate(size_t n) SHARDLAB_ALLOCATE_CONST override;
  SHARDLAB_ALLOCATOR_COPY_DATA
  /// For the process-wide pool (install_for_cpu_tensors): frees what raw_allocate gave, as c10 expects of a CPU
  /// allocator. Null for other pools (their blocks carry their own deleter).
  c10::DeleterFnPtr raw_deleter() const override;

  /// An uninitialized contiguous CPU tensor of `numel` elements of `dtype` whose storage uses this pool.
  at::Tensor empty(int64_t numel, c10::ScalarType dtype);
  /// What the pool holds now and has held.
  PoolStats stats() const;
  /// Gives every cached block back to the system allocator.
  void trim();

  /// Makes a process-wide pool the CPU allocator of every tensor made from now on (requests of `min_bytes` or more
  /// are pooled; smaller ones go to the allocator that was in force), and returns it; a second call returns the
  /// same pool. Tensors made before keep their allocator. It stays installed for the process's life. What a user
  /// of FSDP on CPU may choose over malloc's own policy: see Note [Why FSDP pools its buffers].
  static BufferPool& install_for_cpu_tensors(size_t min_bytes = size_t{1} << 20);

  struct State;  ///< shared with the blocks handed out (implementation detail)

 private:
  std::shared_ptr<State> state_;
  size_t min_bytes_ = 0;
  bool process_wide_ = false;  // blocks are found by address (raw_allocate's contract: context == data)
};

}  // namespace shardlab
