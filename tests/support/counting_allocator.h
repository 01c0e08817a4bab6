#pragma once
// A CPU allocator that counts the bytes every CPU tensor of the process holds, for tests that prove what a piece of
// code really allocates ("nothing hidden"): CountingCpuAllocator::Install puts it in front of the CPU allocator in
// force for its lifetime. The count is process-wide (every thread: ranks as threads, Gloo's workers, the ring's).
#include "shardlab/core/storage/buffer_pool.h"  // SHARDLAB_ALLOCATE_CONST / SHARDLAB_ALLOCATOR_COPY_DATA

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace shardlab::test_support {

class CountingCpuAllocator final : public c10::Allocator {
 public:
  // Bytes held now by tensors allocated while installed.
  int64_t live() const { return live_.load(); }
  // The most held at once since the last reset_peak().
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

  c10::DataPtr allocate(size_t n) SHARDLAB_ALLOCATE_CONST override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    auto* block = new Block{std::move(inner), static_cast<int64_t>(n), const_cast<CountingCpuAllocator*>(this)};
    block->owner->add(block->bytes);
    return c10::DataPtr(data, block, &release, c10::Device(c10::kCPU));
  }
  SHARDLAB_ALLOCATOR_COPY_DATA

  // Counts every CPU allocation while alive; the allocator before it comes back at the end.
  class Install {
   public:
    explicit Install(CountingCpuAllocator& counting) : before_(c10::GetCPUAllocator()) {
      counting.inner_ = before_;
      counting.live_ = 0;
      counting.peak_ = 0;
      c10::SetCPUAllocator(&counting, /*priority=*/100);
    }
    ~Install() { c10::SetCPUAllocator(before_, /*priority=*/100); }
    Install(const Install&) = delete;
    Install& operator=(const Install&) = delete;

   private:
    c10::Allocator* before_;
  };

 private:
  struct Block {
    c10::DataPtr memory;
    int64_t bytes;
    CountingCpuAllocator* owner;
  };
  static void release(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    block->owner->live_ -= block->bytes;
    delete block;
  }
  void add(int64_t bytes) {
    const int64_t now = live_ += bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {}
  }

  c10::Allocator* inner_ = nullptr;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace shardlab::test_support
