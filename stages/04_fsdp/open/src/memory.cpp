#include "shardlab/fsdp/memory.h"

#include "shardlab/core/comm/comm_record.h"
#include "shardlab/core/errors.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace shardlab::fsdp {

void MemoryMeter::allocate(MemoryKind kind, int64_t bytes) {
  if (kind == MemoryKind::kParams) {
    stats_.param_bytes += bytes;
    stats_.peak_param_bytes = std::max(stats_.peak_param_bytes, stats_.param_bytes);
  } else {
    stats_.grad_bytes += bytes;
    stats_.peak_grad_bytes = std::max(stats_.peak_grad_bytes, stats_.grad_bytes);
  }
  sample();
}

void MemoryMeter::sample() {
  if (recording_ && samples_.size() < kMaxSamples)
    samples_.push_back({now_ns(), stats_.param_bytes, stats_.grad_bytes});
}

void MemoryMeter::release(MemoryKind kind, int64_t bytes) {
  int64_t& held = kind == MemoryKind::kParams ? stats_.param_bytes : stats_.grad_bytes;
  SHARDLAB_INTERNAL_ASSERT(bytes <= held, "MemoryMeter (driven by stage 04's FsdpUnit): releasing " +
                                              std::to_string(bytes) + " bytes of " +
                                              (kind == MemoryKind::kParams ? "parameters" : "gradients") +
                                              " while only " + std::to_string(held) + " are held");
  held -= bytes;
  sample();
}

void MemoryMeter::reset_peaks() {
  stats_.peak_param_bytes = stats_.param_bytes;
  stats_.peak_grad_bytes = stats_.grad_bytes;
}

}  // namespace shardlab::fsdp
