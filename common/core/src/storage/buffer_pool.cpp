#include "shardlab/core/storage/buffer_pool.h"

#include "shardlab/core/errors.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

// Note [Why FSDP pools its buffers]
// FSDP allocates and frees the same large buffers every step: a unit's all-gather buffer and gathered buffer, its
// reduce-scatter rows. On a GPU the caching allocator keeps such blocks and hands them out again. On the CPU they go
// to glibc's malloc, whose mmap threshold adapts upward after the first free of a mapped block: from then on blocks
// of that size come from the heap, and the heap keeps freed memory resident. A process running FSDP then held more
// than one running DDP (issue 17: 638-656 MiB against 499-542 MiB per worker), although FSDP holds a quarter of
// the parameters. Fixing the threshold (MALLOC_MMAP_THRESHOLD_) returns the memory but maps and faults every
// buffer in again each time: the step went from 1.9 s to 6.9 s.
// A pool keeps what FSDP's own schedule needs and nothing more: the blocks in use at the schedule's peak, reused
// step after step, with no fault and no heap growth. Its reserved bytes are about the peak of the parameter
// buffers plus the peak of the reduce buffers: blocks are cached by size, and an all-gather-sized block never
// serves a reduce-sized request (nor the reverse). The Communicator's and the hooks' copies, which the memory
// theory counts too, do not come from this pool. A cached block is reused for a request of its size or slightly
// smaller, down to 8/9 of it (a block of n bytes serves requests S with S <= n <= S + S/8: the units of a model
// are mostly of one size; the root differs), so the cache does not grow a block per request size.
// The units' buffers are not all: autograd's gradients, the activations, the Communicator's copies and Gloo's own
// go to malloc too. BufferPool::install_for_cpu_tensors makes a pool the allocator of every CPU tensor of 1 MiB or
// more, as the CUDA caching allocator is for every CUDA tensor; `tools/bench/allocators` measures it beside glibc's
// default, its fixed mmap threshold, jemalloc and mimalloc, on resident memory and on step time.

namespace shardlab {

struct BufferPool::State {
  c10::Allocator* system = nullptr;
  mutable std::mutex mutex;
  std::multimap<size_t, c10::DataPtr> cached;                      // by size
  std::unordered_map<void*, std::pair<c10::DataPtr, size_t>> out;  // the process-wide pool's blocks handed out
  PoolStats stats;
};

namespace {

struct Block {
  std::shared_ptr<BufferPool::State> state;
  c10::DataPtr memory;
  size_t size = 0;
};

void give_back(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  {
    std::lock_guard<std::mutex> lock(block->state->mutex);
    PoolStats& s = block->state->stats;
    s.in_use_bytes -= static_cast<int64_t>(block->size);
    s.cached_bytes += static_cast<int64_t>(block->size);
    block->state->cached.emplace(block->size, std::move(block->memory));
  }
  delete block;
}

// install_for_cpu_tensors's pool's state. A plain pointer (no destructor at exit): the pool is never deleted, and
// tensors freed during static destruction still find it.
BufferPool::State* g_process_pool = nullptr;

// The process-wide pool's deleter: the block is found by its address. An address it never handed out is one the
// allocator beneath gave for a small request (raw_deallocate brings those here too).
void give_back_by_address(void* data) {
  BufferPool::State& state = *g_process_pool;
  std::unique_lock<std::mutex> lock(state.mutex);
  auto it = state.out.find(data);
  if (it == state.out.end()) {
    lock.unlock();
    state.system->raw_deallocate(data);
    return;
  }
  const size_t size = it->second.second;
  state.stats.in_use_bytes -= static_cast<int64_t>(size);
  state.stats.cached_bytes += static_cast<int64_t>(size);
  state.cached.emplace(size, std::move(it->second.first));
  state.out.erase(it);
}

}  // namespace

BufferPool::BufferPool(c10::Allocator* system, size_t min_bytes)
    : state_(std::make_shared<State>()), min_bytes_(min_bytes) {
  state_->system = system != nullptr ? system : c10::GetCPUAllocator();
  SHARDLAB_INTERNAL_ASSERT(state_->system != this, "BufferPool: a pool cannot draw from itself");
}

BufferPool::~BufferPool() = default;  // blocks still out keep the state; they are cached, then freed with it

c10::DataPtr BufferPool::allocate(size_t n) SHARDLAB_ALLOCATE_CONST {
  if (n == 0) return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
  if (n < min_bytes_) return state_->system->allocate(n);  // with the system's own deleter
  c10::DataPtr memory;
  size_t size = n;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    PoolStats& s = state_->stats;
    auto it = state_->cached.lower_bound(n);
    if (it != state_->cached.end() && it->first <= n + n / 8) {
      size = it->first;
      memory = std::move(it->second);
      state_->cached.erase(it);
      s.cached_bytes -= static_cast<int64_t>(size);
      ++s.reuses;
    } else {
      ++s.system_allocations;
    }
    s.in_use_bytes += static_cast<int64_t>(size);
  }
  if (!memory) {
    try {
      memory = state_->system->allocate(n);
    } catch (...) {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stats.in_use_bytes -= static_cast<int64_t>(size);
      throw;
    }
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    PoolStats& s = state_->stats;
    s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.in_use_bytes + s.cached_bytes);
  }
  void* data = memory.get();
  if (process_wide_) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->out.emplace(data, std::make_pair(std::move(memory), size));
    return c10::DataPtr(data, data, &give_back_by_address, c10::Device(c10::kCPU));
  }
  auto* block = new Block{state_, std::move(memory), size};
  return c10::DataPtr(data, block, &give_back, c10::Device(c10::kCPU));
}

at::Tensor BufferPool::empty(int64_t numel, c10::ScalarType dtype) {
  return at::detail::empty_generic({numel}, this, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, c10::nullopt);
}

PoolStats BufferPool::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

BufferPool& BufferPool::install_for_cpu_tensors(size_t min_bytes) {
  static BufferPool* pool = [min_bytes] {
    auto* p = new BufferPool(c10::GetCPUAllocator(), min_bytes);  // never deleted: tensors may outlive main
    p->process_wide_ = true;
    g_process_pool = p->state_.get();
    c10::SetCPUAllocator(p, /*priority=*/50);
    // c10 ignores an allocator of lower priority than the one set: say so instead of measuring the wrong one.
    if (c10::GetCPUAllocator() != p)
      throw std::runtime_error(
          "BufferPool::install_for_cpu_tensors: c10 kept another CPU allocator (set at a priority above 50); "
          "expected the pool to become the CPU allocator");
    return p;
  }();
  return *pool;
}

c10::DeleterFnPtr BufferPool::raw_deleter() const { return process_wide_ ? &give_back_by_address : nullptr; }

void BufferPool::trim() {
  std::vector<c10::DataPtr> freed;  // freed outside the lock
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (auto& [size, memory] : state_->cached) freed.push_back(std::move(memory));
  state_->cached.clear();
  state_->stats.cached_bytes = 0;
}

}  // namespace shardlab
