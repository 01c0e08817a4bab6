#pragma once
// Internal to shardlab::core (not installed): a thread that runs tasks one after another, and the c10d Work a
// task completes, so that an algorithm built from several c10d calls (the ring reduce-scatter) is asynchronous
// like a single collective. See Note [Ring reduce-scatter] in comm/ring_collectives.cpp.

#include "shardlab/core/compat.h"

#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace shardlab::detail {

/// c10d Work completed by whoever runs the task: `wait(timeout)` (c10d's own) blocks until complete() and rethrows
/// the task's error; `getFuture()` completes at the same moment (the CommRecorder times the record with it).
class TaskWork : public compat::Work {
 public:
  TaskWork() : future_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())) {}
  /// Marks the work done, successfully when `error` is null.
  void complete(const std::exception_ptr& error) {
    // The future first (its callbacks close the CommRecorder's record), then what wait() waits for, as c10d's own
    // Gloo works do: a record is never still open when wait() returns.
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue());
    }
    finish(error);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// Runs submitted tasks on one thread, in submission order. The destructor runs what is queued, then joins.
class SerialWorker {
 public:
  SerialWorker() : thread_([this] { loop(); }) {}
  ~SerialWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  /// Queues `task`; it must not throw (report errors through its TaskWork).
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stop_ and nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the rest is ready
};

}  // namespace shardlab::detail
