#include "shardlab/fsdp/memory.h"

#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/errors.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/TensorOptions.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace shardlab::fsdp {

struct MemoryMeter::State {
  std::mutex mutex;
  MemoryStats stats;
  bool recording = false;
  std::vector<MemorySample> samples;

  // Both under `mutex`.
  void add(MemoryKind kind, int64_t bytes) {
    if (kind == MemoryKind::kParams) {
      stats.param_bytes += bytes;
      stats.peak_param_bytes = std::max(stats.peak_param_bytes, stats.param_bytes);
    } else {
      stats.grad_bytes += bytes;
      stats.peak_grad_bytes = std::max(stats.peak_grad_bytes, stats.grad_bytes);
    }
    sample();
  }
  void sample() {
    if (recording && samples.size() < kMaxSamples) samples.push_back({now_ns(), stats.param_bytes, stats.grad_bytes});
  }
};

MemoryMeter::MemoryMeter() : state_(std::make_shared<State>()) {}

void MemoryMeter::record_samples(bool on) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->recording = on;
}

std::vector<MemorySample> MemoryMeter::samples() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->samples;
}

void MemoryMeter::allocate(MemoryKind kind, int64_t bytes) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->add(kind, bytes);
}

void MemoryMeter::release(MemoryKind kind, int64_t bytes) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  int64_t& held = kind == MemoryKind::kParams ? state_->stats.param_bytes : state_->stats.grad_bytes;
  SHARDLAB_INTERNAL_ASSERT(bytes <= held, "MemoryMeter (driven by stage 04's FsdpUnit): releasing " +
                                              std::to_string(bytes) + " bytes of " +
                                              (kind == MemoryKind::kParams ? "parameters" : "gradients") +
                                              " while only " + std::to_string(held) + " are held");
  held -= bytes;
  state_->sample();
}

MemoryStats MemoryMeter::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

void MemoryMeter::reset_peaks() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->stats.peak_param_bytes = state_->stats.param_bytes;
  state_->stats.peak_grad_bytes = state_->stats.grad_bytes;
}

namespace {

// A block CountingAllocator handed out: the inner allocator's, and what it counted.
struct CountedBlock {
  c10::DataPtr inner;
  int64_t bytes;
  MemoryKind kind;
  std::shared_ptr<MemoryMeter::State> state;
};

// The block's deleter: the count goes down the moment the block is freed, on whatever thread frees it. It runs in a
// destructor and must not throw: a sample it cannot keep (out of memory) is dropped.
void free_counted(void* context) noexcept {
  auto* block = static_cast<CountedBlock*>(context);
  try {
    std::lock_guard<std::mutex> lock(block->state->mutex);
    block->state->add(block->kind, -block->bytes);
  } catch (...) {  // std::mutex::lock or the sample's push_back: nothing a deleter can report
  }
  delete block;  // frees the inner block (back to its pool, or to the system)
}

}  // namespace

CountingAllocator::CountingAllocator(c10::Allocator* inner, MemoryMeter& meter, MemoryKind kind)
    : inner_(inner), state_(meter.state_), kind_(kind) {
  SHARDLAB_INTERNAL_ASSERT(inner_ != nullptr, "CountingAllocator: a null inner allocator");
}

c10::DataPtr CountingAllocator::allocate(size_t n) SHARDLAB_ALLOCATE_CONST {
  c10::DataPtr inner = inner_->allocate(n);
  if (n == 0) return inner;  // nothing held: no sample either (a free_storage swaps in an empty block)
  void* data = inner.get();
  const c10::Device device = inner.device();
  auto* block = new CountedBlock{std::move(inner), static_cast<int64_t>(n), kind_, state_};
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->add(kind_, block->bytes);
  }
  return {data, block, &free_counted, device};
}

at::Tensor CountingAllocator::empty(int64_t numel, c10::ScalarType dtype, c10::Device device) {
  const c10::DeviceGuard guard(device);  // a device's allocator allocates on the current device
  const c10::DispatchKeySet keys(c10::computeDispatchKey(dtype, c10::kStrided, device));
  return at::detail::empty_generic({numel}, this, keys, dtype, c10::nullopt);
}

}  // namespace shardlab::fsdp
