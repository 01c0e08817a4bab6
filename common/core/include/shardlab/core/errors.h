#pragma once
// The three error tiers of shardlab, and the starter's "not implemented". See Note [Three error tiers].
#include <stdexcept>
#include <string>

namespace shardlab {

// Note [Three error tiers]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// 1. A user check: input the caller can fix. Throws std::invalid_argument (bad values) or std::logic_error
//    (a call out of order, such as two backward passes outside no_sync), with a message that names what was
//    expected and what came. Tests catch these by type and read the message.
// 2. An internal assertion (SHARDLAB_INTERNAL_ASSERT): an invariant shardlab itself keeps, never the user's
//    doing. Throws InternalError naming the condition, the file and the line, and saying it is a shardlab bug.
//    It is not a std::logic_error, so a test that expects a user check cannot pass on an internal failure.
// 3. A warning once (warn_once): a legal path that is slower or larger than the user may think (Gloo's
//    reduce-scatter sent as an all-reduce; bf16 sent as f32). Printed once per process and key on stderr,
//    then counted silently; training goes on.
// Apart from the tiers: NotImplemented, what a student's starter throws from every region still to write. It
// derives from std::exception alone, so no test that expects a user check or a collective failure passes on a
// starter (tools/check-starter looks for its message, "not implemented: stage NN").

/// An invariant shardlab keeps was broken: a bug in shardlab, not in the caller's use of it.
class InternalError : public std::exception {
 public:
  /// `what`: the full message (see SHARDLAB_INTERNAL_ASSERT).
  explicit InternalError(std::string what) : what_(std::move(what)) {}
  /// The message: the condition, where it was checked, and the detail given.
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

/// What a generated starter throws where the student's code goes: "not implemented: stage NN — <task>".
class NotImplemented : public std::exception {
 public:
  /// `stage`: two digits ("02"); `task`: what the region is to do.
  NotImplemented(const std::string& stage, const std::string& task)
      : what_("not implemented: stage " + stage + " \u2014 " + task) {}
  /// The message, "not implemented: stage NN — <task>".
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

namespace detail {
/// Throws InternalError for SHARDLAB_INTERNAL_ASSERT: `cond` (its text) failed at `file`:`line`.
[[noreturn]] void internal_assert_fail(const char* cond, const char* file, int line, const std::string& detail);
}  // namespace detail

/// Prints `message` on stderr, prefixed "shardlab warning: ", the first time `key` is seen in this process; later
/// calls with the same key only count. Thread-safe. Returns true when it printed.
bool warn_once(const std::string& key, const std::string& message);

/// How many times warn_once was called with `key` (printed or not); 0 for a key never seen.
int warn_count(const std::string& key);

}  // namespace shardlab

/// Checks an invariant shardlab keeps (tier 2 of Note [Three error tiers]): when `cond` is false, throws
/// shardlab::InternalError naming the condition, the file, the line and `message` (a std::string expression,
/// evaluated only on failure).
#define SHARDLAB_INTERNAL_ASSERT(cond, message)                                                  \
  do {                                                                                           \
    if (!(cond)) ::shardlab::detail::internal_assert_fail(#cond, __FILE__, __LINE__, (message)); \
  } while (false)
