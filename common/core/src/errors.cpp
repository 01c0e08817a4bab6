#include "shardlab/core/errors.h"

#include <iostream>
#include <map>
#include <mutex>

namespace shardlab {
namespace {

std::mutex& warn_mutex() {
  static std::mutex mu;
  return mu;
}

std::map<std::string, int>& warn_counts() {
  static std::map<std::string, int> counts;
  return counts;
}

}  // namespace

namespace detail {

void internal_assert_fail(const char* cond, const char* file, int line, const std::string& detail) {
  throw InternalError(std::string("shardlab internal error: ") + cond + " failed at " + file + ":" +
                      std::to_string(line) + (detail.empty() ? "" : ": " + detail) +
                      ". This is a bug in shardlab, not in your use of it; please report it with this message");
}

}  // namespace detail

bool warn_once(const std::string& key, const std::string& message) {
  std::lock_guard<std::mutex> lock(warn_mutex());
  if (warn_counts()[key]++ > 0) return false;
  std::cerr << "shardlab warning: " << message << std::endl;
  return true;
}

int warn_count(const std::string& key) {
  std::lock_guard<std::mutex> lock(warn_mutex());
  auto it = warn_counts().find(key);
  return it == warn_counts().end() ? 0 : it->second;
}

}  // namespace shardlab
