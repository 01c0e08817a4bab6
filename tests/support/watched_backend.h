#pragma once
// Watching the collectives from below (stages 01 and 02): when each broadcast and all-reduce is waited for, whether
// every rank issues the same ones in the same order, and an all-reduce that fails on purpose. Installed on every rank
// through GroupOptions::wrap_backend (watched_group).
#include "shardlab/core/comm/comm_record.h"
#include "support/failing_backend.h"
#include "support/group.h"

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab::test_support {

/// What a WatchedBackend saw on its rank, and what it was told to do. Read by the test once the ranks are done, or
/// under `mu` by the rank itself.
struct Watch {
  std::mutex mu;
  std::vector<int64_t> waited_ns;  ///< now_ns() of every wait() on a broadcast or an all-reduce, in call order
  int64_t all_reduces = 0;         ///< all-reduces issued on this rank so far
  int64_t fail_at = -1;            ///< the index (into all_reduces) of the one to fail instead of issuing; -1: none
};

/// Every rank's broadcasts and all-reduces in issue order ("broadcast of 56 elements from root 0"), shared by the
/// ranks: the backend pairs collectives by position, so the k-th of every rank must be the same.
struct Sequences {
  std::mutex mu;
  std::vector<std::vector<std::string>> issued;  ///< [rank] -> its collectives so far
  std::vector<std::string> mismatches;           ///< what check() refused

  explicit Sequences(int world) : issued(world) {}

  /// Notes `rank`'s next collective; refuses it (throws, and notes why) when another rank's collective at the same
  /// position differs: issued anyway, the backend would pair it with that one (Gloo aborts the process on a size
  /// mismatch).
  void check(int rank, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    const size_t k = issued[rank].size();
    for (size_t q = 0; q < issued.size(); ++q)
      if (static_cast<int>(q) != rank && issued[q].size() > k && issued[q][k] != what) {
        mismatches.push_back("collective #" + std::to_string(k) + ": rank " + std::to_string(rank) + " issues " + what +
                             ", rank " + std::to_string(q) + " issued " + issued[q][k]);
        throw std::runtime_error("refused, it differs from another rank's: " + mismatches.back());
      }
    issued[rank].push_back(what);
  }
};

/// The backend's own work, with every wait() on it noted in the Watch first.
class WatchedWork : public compat::Work {
 public:
  WatchedWork(c10::intrusive_ptr<compat::Work> inner, Watch* watch) : inner_(std::move(inner)), watch_(watch) {}
  bool wait(std::chrono::milliseconds timeout) override {
    {
      std::lock_guard<std::mutex> lock(watch_->mu);
      watch_->waited_ns.push_back(now_ns());
    }
    return inner_->wait(timeout);
  }
  bool isCompleted() override { return inner_->isCompleted(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  c10::intrusive_ptr<compat::Work> inner_;
  Watch* watch_;
};

/// Forwards every op to the real backend (a DelayedBackend without delays). Checks each broadcast and all-reduce
/// against the other ranks' (when given Sequences), notes when each is waited for, and fails the all-reduce
/// Watch::fail_at names, on every rank told to, without issuing it (so the ranks' collectives still pair).
class WatchedBackend : public DelayedBackend {
 public:
  WatchedBackend(c10::intrusive_ptr<compat::Backend> inner, Watch* watch, Sequences* sequences)
      : DelayedBackend(std::move(inner), DelayPlan{}, nullptr), watch_(watch), sequences_(sequences) {}
  c10::intrusive_ptr<compat::Work> allreduce(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceOptions& opts) override {
    if (sequences_ != nullptr)
      sequences_->check(getRank(), "all_reduce of " + std::to_string(tensors.at(0).numel()) + " elements");
    bool fail = false;
    {
      std::lock_guard<std::mutex> lock(watch_->mu);
      fail = watch_->all_reduces++ == watch_->fail_at;
    }
    if (fail) return c10::make_intrusive<FailedWork>(FailingBackend::kMessage);
    return c10::make_intrusive<WatchedWork>(DelayedBackend::allreduce(tensors, opts), watch_);
  }
  c10::intrusive_ptr<compat::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) override {
    if (sequences_ != nullptr)
      sequences_->check(getRank(), "broadcast of " + std::to_string(tensors.at(0).numel()) + " elements from root " +
                                       std::to_string(opts.rootRank));
    return c10::make_intrusive<WatchedWork>(DelayedBackend::broadcast(tensors, opts), watch_);
  }

 private:
  Watch* watch_;
  Sequences* sequences_;
};

/// test_group() with every rank's backend watched by watches[rank], and checked against `sequences` when given.
inline GroupOptions watched_group(std::vector<Watch>& watches, Sequences* sequences = nullptr) {
  GroupOptions options = test_group();
  options.wrap_backend = [&watches, sequences](c10::intrusive_ptr<compat::Backend> inner, int rank) {
    return c10::make_intrusive<WatchedBackend>(std::move(inner), &watches[rank], sequences);
  };
  return options;
}

}  // namespace shardlab::test_support
