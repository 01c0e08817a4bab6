#pragma once
/// @file numbers.h
/// Numbers read from text that someone else wrote (a checkpoint's metadata, an environment variable, a command
/// line): one strict reader, so every place refuses the same malformed text.

#include <cstdint>
#include <optional>
#include <string_view>

namespace shardlab {

/// `text` as a decimal integer in [lo, hi]: digits only, with a leading '-' where lo < 0, and nothing before or
/// after them (no spaces, no '+', no "12abc", no "1e3"). std::nullopt for anything else, out of range included, so
/// the caller words the error with what it knows (the flag, the file and key, the variable).
std::optional<int64_t> parse_integer(std::string_view text, int64_t lo, int64_t hi);

}  // namespace shardlab
