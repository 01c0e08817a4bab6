#pragma once
// A c10d backend that forwards every op the Communicator issues to a real one, after a random delay drawn per op
// kind: the way tests shift the timing of collectives (on one rank, or on all of them) without touching the code
// under test. Installed through GroupOptions::wrap_backend.
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/compat.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace shardlab::test_support {

/// The most each kind of op waits before it is issued; each wait is drawn uniformly from [0, max].
struct DelayPlan {
  std::chrono::microseconds all_gather{0};      ///< allgather, _allgather_base, and each step of a ring all-gather
  std::chrono::microseconds reduce_scatter{0};  ///< _reduce_scatter_base, and each step of a ring reduce-scatter
  std::chrono::microseconds other{0};           ///< allreduce, broadcast, barrier
  uint32_t seed = 0;                            ///< with the rank, seeds the draws
};

/// How many ops of each kind a DelayedBackend delayed (a test checks that its delays really happened).
struct DelayCounts {
  std::atomic<int64_t> all_gather{0};      ///< ops delayed as all-gathers
  std::atomic<int64_t> reduce_scatter{0};  ///< ops delayed as reduce-scatters
  std::atomic<int64_t> other{0};           ///< other ops delayed
};

/// Forwards to `inner` after the plan's delay; the ring's send/recv are told apart by their tag
/// (kRingAllGatherTagBase). Thread-safe: the Communicator's ring workers issue beside the caller.
class DelayedBackend : public compat::Backend {
 public:
  /// Wraps `inner` (rank and size are inner's); `counts` (may be null) is bumped at every delay.
  DelayedBackend(c10::intrusive_ptr<compat::Backend> inner, DelayPlan plan, DelayCounts* counts)
      : compat::Backend(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        plan_(plan),
        counts_(counts),
        random_(plan.seed * 7919U + static_cast<uint32_t>(getRank())) {}

  const std::string getBackendName() const override { return "delayed(" + inner_->getBackendName() + ")"; }

  c10::intrusive_ptr<compat::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) override {
    delay(plan_.other, Kind::kOther);
    return inner_->broadcast(tensors, opts);
  }
  c10::intrusive_ptr<compat::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) override {
    delay(plan_.other, Kind::kOther);
    return inner_->allreduce(tensors, opts);
  }
  c10::intrusive_ptr<compat::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const c10d::AllgatherOptions& opts) override {
    delay(plan_.all_gather, Kind::kAllGather);
    return inner_->allgather(outputs, inputs, opts);
  }
  c10::intrusive_ptr<compat::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override {
    delay(plan_.all_gather, Kind::kAllGather);
    return inner_->_allgather_base(output, input, opts);
  }
  c10::intrusive_ptr<compat::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::ReduceScatterOptions& opts) override {
    delay(plan_.reduce_scatter, Kind::kReduceScatter);
    return inner_->_reduce_scatter_base(output, input, opts);
  }
  c10::intrusive_ptr<compat::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    if (tag >= kRingAllGatherTagBase)
      delay(plan_.all_gather, Kind::kAllGather);
    else
      delay(plan_.reduce_scatter, Kind::kReduceScatter);
    return inner_->send(tensors, dst, tag);
  }
  c10::intrusive_ptr<compat::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return inner_->recv(tensors, src, tag);  // the step was delayed at its send
  }
  c10::intrusive_ptr<compat::Work> barrier(const c10d::BarrierOptions& opts) override {
    delay(plan_.other, Kind::kOther);
    return inner_->barrier(opts);
  }

 private:
  enum class Kind { kAllGather, kReduceScatter, kOther };

  void delay(std::chrono::microseconds max, Kind kind) {
    if (max.count() <= 0) return;
    int64_t us = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      us = std::uniform_int_distribution<int64_t>(0, max.count())(random_);
    }
    if (counts_ != nullptr) {
      auto& n = kind == Kind::kAllGather       ? counts_->all_gather
                : kind == Kind::kReduceScatter ? counts_->reduce_scatter
                                               : counts_->other;
      ++n;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }

  c10::intrusive_ptr<compat::Backend> inner_;
  DelayPlan plan_;
  DelayCounts* counts_;
  std::mutex mutex_;
  std::mt19937 random_;
};

}  // namespace shardlab::test_support
