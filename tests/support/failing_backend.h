#pragma once
// A c10d backend that forwards every op to a real one, except chosen all-reduces, which it never issues and reports
// as failed: the way tests make one collective fail without a hang. Install it on every rank with the same choice,
// so every rank skips the same all-reduce and the real ones stay paired. Installed through GroupOptions::wrap_backend.
#include "support/delayed_backend.h"

#include <ATen/core/ivalue.h>

#include <atomic>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab::test_support {

/// A Work that has already failed with `message`: wait() and its future give the error.
class FailedWork : public compat::Work {
 public:
  explicit FailedWork(const std::string& message)
      : future_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())) {
    const auto error = std::make_exception_ptr(std::runtime_error(message));
    future_->setError(error);
    finish(error);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// Forwards to `inner`, but all-reduce number k (1-based, counted on this backend) fails for every k in `fail`,
/// and the backend's all-gather number k for every k in `fail_all_gathers` (the Communicator's ring all-gather is
/// send/recv and never comes here: choose AllGatherAlgorithm::kBackend to reach it).
class FailingBackend : public DelayedBackend {
 public:
  /// The message of every injected all-reduce failure.
  static constexpr const char* kMessage = "injected failure of an all-reduce (test_support::FailingBackend)";
  /// The message of every injected all-gather failure.
  static constexpr const char* kAllGatherMessage = "injected failure of an all-gather (test_support::FailingBackend)";

  FailingBackend(c10::intrusive_ptr<compat::Backend> inner, std::set<int> fail, std::set<int> fail_all_gathers = {})
      : DelayedBackend(std::move(inner), DelayPlan{}, nullptr),
        fail_(std::move(fail)),
        fail_all_gathers_(std::move(fail_all_gathers)) {}

  c10::intrusive_ptr<compat::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const c10d::AllgatherOptions& opts) override {
    if (fail_all_gathers_.count(++all_gathers_) > 0) return c10::make_intrusive<FailedWork>(kAllGatherMessage);
    return DelayedBackend::allgather(outputs, inputs, opts);
  }
  c10::intrusive_ptr<compat::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                   const c10d::AllgatherOptions& opts) override {
    if (fail_all_gathers_.count(++all_gathers_) > 0) return c10::make_intrusive<FailedWork>(kAllGatherMessage);
    return DelayedBackend::_allgather_base(output, input, opts);
  }

  c10::intrusive_ptr<compat::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) override {
    const int k = ++count_;
    if (fail_.count(k) > 0) return c10::make_intrusive<FailedWork>(kMessage);
    return DelayedBackend::allreduce(tensors, opts);
  }

  /// All-reduces seen so far, failed ones included.
  int count() const { return count_; }

 private:
  std::set<int> fail_;
  std::set<int> fail_all_gathers_;
  std::atomic<int> count_{0};
  std::atomic<int> all_gathers_{0};
};

}  // namespace shardlab::test_support
