#include "shardlab/core/numbers.h"

#include <charconv>
#include <system_error>

namespace shardlab {

std::optional<int64_t> parse_integer(std::string_view text, int64_t lo, int64_t hi) {
  // std::from_chars already refuses leading spaces and '+', and reports overflow instead of saturating; "-0"
  // is refused by hand where no sign is expected.
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || (lo >= 0 && text.front() == '-') || error != std::errc() || stop != end || value < lo ||
      value > hi)
    return std::nullopt;
  return value;
}

}  // namespace shardlab
