// Handles: the asynchronous work handle every collective returns (Handle), waiting for it within the group's timeout
// (telling a timeout from a backend failure), chaining a step after it (then, on_advance) or a second collective
// (then_issue, advance), and waiting for many at once (wait_all). Nothing here knows how a collective is issued.

#include "shardlab/core/comm/communicator.h"

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

Handle::Handle(c10::intrusive_ptr<compat::Work> work, std::function<void()> finish, std::string what,
               std::chrono::milliseconds timeout)
    : work_(std::move(work)), finish_(std::move(finish)), what_(std::move(what)), timeout_(timeout), done_(false) {}

// Note [Overwriting a pending Handle]
// A pending handle owns the collective's finish step (divide for AVG, copy back a cast, copy out a chunk): only
// wait() runs it. Move-assigning onto a pending handle would drop that step silently, and the result would be wrong
// with nothing to show for it (an AVG left as a SUM). The assignment could wait for it instead, but that hides a
// blocking call (and its errors) inside an `=`. So it refuses: std::logic_error naming the op, like std::thread's
// assignment refuses a joinable thread (which terminates). Nothing is moved in that case, so the pending handle can
// still be waited for. Handles that are done (waited for, moved from, default) are overwritten freely. Containers
// move-construct when they grow (fine); erase or remove_if move-assign onto the erased element, so erase a
// handle only once it is done.
Handle& Handle::operator=(Handle&& other) {  // NOLINT(performance-noexcept-move-constructor): see the Note
  if (this == &other) return *this;
  if (!done_)
    throw std::logic_error("Handle: move-assigning onto a pending " + what_ +
                           " would drop its finish step; expected a handle that is done (call wait() first)");
  work_ = std::move(other.work_);
  finish_ = std::move(other.finish_);
  what_ = std::move(other.what_);
  timeout_ = other.timeout_;
  error_ = std::move(other.error_);
  advance_ = std::move(other.advance_);
  done_ = std::exchange(other.done_, true);
  return *this;
}

void Handle::wait() {
  if (error_) std::rethrow_exception(error_);
  if (done_) return;
  // Take everything out first: whatever happens below, the finish steps cannot run a second time.
  auto work = std::move(work_);
  auto finish = std::move(finish_);
  finish_ = nullptr;
  done_ = true;
  const auto waited_from = std::chrono::steady_clock::now();
  try {
    if (work && !work->wait(timeout_)) throw std::runtime_error("the backend reported failure");
  } catch (const std::exception& e) {
    // Which of the two: the limit ran out (a peer never came), or the backend failed at once (a peer's connection
    // was reset, a peer threw). Gloo names its timeouts; a wait as long as the limit is one too.
    const std::string why = e.what();
    const auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - waited_from);
    const bool timed_out =
        waited >= timeout_ || why.find("imed out") != std::string::npos || why.find("imeout") != std::string::npos;
    const std::string limit = std::to_string(timeout_.count()) + " ms";
    error_ = std::make_exception_ptr(
        std::runtime_error(what_ +
                           (timed_out ? " timed out (limit " + limit + "): "
                                      : " failed after " + std::to_string(waited.count()) + " ms, before its " + limit +
                                            " limit (not a timeout: the backend reported an error, such as a peer's "
                                            "connection reset): ") +
                           why));
    std::rethrow_exception(error_);
  }
  if (finish) {
    try {
      finish();
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
  }
}

std::exception_ptr wait_all(std::vector<Handle>& handles) {
  std::exception_ptr first;
  // Advance every chained handle first, in order, so that each one's second collective is in flight before any is
  // waited for (Note [Advancing a chained reduction]); for a plain handle advance() is its wait().
  for (auto& h : handles) {
    try {
      h.advance();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  for (auto& h : handles) {
    try {
      h.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  return first;
}

Handle Handle::then(std::function<void()> next) && {
  std::function<void()> first = std::move(finish_);
  auto chained = [first = std::move(first), next = std::move(next), was_done = done_] {
    if (!was_done && first) first();
    if (next) next();
  };
  Handle h(std::move(work_), std::move(chained), std::move(what_), timeout_);
  h.error_ = std::move(error_);
  h.advance_ = std::move(advance_);
  done_ = true;
  return h;
}

// Note [Advancing a chained reduction]
// A two-phase reduction (HSDP: reduce-scatter within the shard group, all-reduce of the result across the replicas)
// cannot chain its second collective with then(): a then() step runs at wait(), and its owner (FSDP) waits for a
// reduction only when it must, so the all-reduce would start late, and a wait() before the next reduce-scatter
// would hold the host until the all-reduce is over. then_issue() splits the wait: advance() waits for the first
// collective and issues the second; wait() finishes the rest. FSDP advances the previous unit's reduction before it
// issues the next unit's reduce-scatter (the host waited there already in stage 04, for the reduce-scatter's
// buffers) and waits for all of them at the end of backward. Every rank advances in the same order, so each
// group's collectives come in the same order on every rank ((unit, phase) order), whatever the timing.
Handle Handle::then_issue(std::function<Handle()> issue) && {
  struct Chain {
    Handle first;
    std::function<Handle()> issue;
    Handle second;
    bool issued = false;
    std::exception_ptr error;  // what issue() threw: every later advance rethrows it
  };
  auto chain = std::make_shared<Chain>();
  std::string what = what_ + ", then its second collective";
  const std::chrono::milliseconds timeout = timeout_;
  chain->first = std::move(*this);
  chain->issue = std::move(issue);
  auto advance = [chain] {
    if (chain->error) std::rethrow_exception(chain->error);
    if (chain->issued) return;
    chain->first.wait();   // a failure sticks in `first`: the next advance rethrows it
    chain->issued = true;  // issue() runs once: a throwing one is not retried, its error sticks
    try {
      if (chain->issue) chain->second = chain->issue();
      chain->issue = nullptr;  // what it captured (the first phase's buffers) goes now, not at wait()
    } catch (...) {
      chain->error = std::current_exception();
      throw;
    }
  };
  Handle h(
      c10::intrusive_ptr<compat::Work>(),
      [chain, advance] {
        advance();
        chain->second.wait();
      },
      std::move(what), timeout);
  h.advance_ = advance;
  return h;
}

void Handle::advance() {
  if (error_) std::rethrow_exception(error_);
  if (done_) return;
  if (!advance_) {
    wait();
    return;
  }
  try {
    advance_();
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
}

Handle Handle::on_advance(std::function<void()> step) && {
  auto once = std::make_shared<std::function<void()>>(std::move(step));
  auto run = [once] {
    if (!*once) return;
    auto f = std::exchange(*once, nullptr);
    f();
  };
  std::function<void()> advance = std::move(advance_);
  advance_ = nullptr;
  Handle h = std::move(*this).then(run);  // wait() without an advance() first
  if (advance)
    h.advance_ = [advance = std::move(advance), run] {
      advance();
      run();
    };
  return h;
}

}  // namespace shardlab
