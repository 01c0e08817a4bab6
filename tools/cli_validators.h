/// @file cli_validators.h
/// CLI11 validators in the tools' words, shared by `shardlab` and `shardlab-run`. CLI11 reports a failed check as
/// "--flag: <message>", so every message says what was expected and what came: "--world-size: expects an integer in
/// [1, 64]; got '0'". The description (shown in --help after the type) is the accepted form.
#pragma once

#include "shardlab/core/numbers.h"

#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace shardlab::cli {

/// An integer in [lo, hi], read strictly (parse_integer: no spaces, no '+', nothing after the digits) and in decimal:
/// the value is rewritten to the number, so give it to Option::transform, which keeps the rewrite (check does not).
inline CLI::Validator integer_in(int64_t lo, int64_t hi) {
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& v) -> std::string {
        const std::optional<int64_t> n = parse_integer(v, lo, hi);
        if (!n) return "expects an integer in " + range + "; got '" + v + "'";
        v = std::to_string(*n);  // "010" is ten: CLI11 would convert it as octal (strtoll, base 0)
        return "";
      },
      "INT in " + range);
}

/// One of `allowed`, spelled exactly.
inline CLI::Validator one_of(std::vector<std::string> allowed) {
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : "|") + a;
  return CLI::Validator(
      [allowed, list](std::string& v) -> std::string {
        if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return "";
        return "expects one of " + list + "; got '" + v + "'";
      },
      list);
}

/// A finite number > 0, the whole of the value read (std::stod: "1e-3" yes, "1x" no).
inline CLI::Validator positive_number() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        size_t used = 0;
        double x = 0;
        try {
          x = std::stod(v, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == v.size() && !v.empty() && x > 0 && std::isfinite(x)) return "";
        return "expects a finite positive number; got '" + v + "'";
      },
      "X > 0");
}

/// A path that exists: a directory when `directory`, else anything but one. `what` says what it is for
/// ("the python3 with torch"), and the message says which of the two it was not.
inline CLI::Validator existing(bool directory, const std::string& what) {
  return CLI::Validator(
      [directory, what](std::string& v) -> std::string {
        std::error_code ec;
        const auto status = std::filesystem::status(v, ec);
        if (!std::filesystem::exists(status)) return "expects " + what + "; got '" + v + "', which does not exist";
        if (std::filesystem::is_directory(status) != directory)
          return "expects " + what + "; got '" + v + "', " + (directory ? "not a directory" : "a directory");
        return "";
      },
      directory ? "DIR" : "FILE");
}

/// A file to write: not a directory, in an existing directory this process may write into (the file itself need not
/// exist). `what` says what it is ("a file to write"). Checked before the work that would write it, not after.
inline CLI::Validator file_to_write(const std::string& what) {
  return CLI::Validator(
      [what](std::string& v) -> std::string {
        std::error_code ec;
        const std::filesystem::path file(v), dir = file.has_parent_path() ? file.parent_path() : ".";
        if (v.empty() || std::filesystem::is_directory(file, ec))
          return "expects " + what + "; got '" + v + "'" + (v.empty() ? "" : ", a directory");
        if (!std::filesystem::is_directory(dir, ec))
          return "expects " + what + " in an existing directory; got '" + v + "' (no directory '" + dir.string() + "')";
        if (access(dir.c_str(), W_OK) != 0)
          return "expects " + what + " in a directory it can write; got '" + v + "' ('" + dir.string() +
                 "' is not writable)";
        return "";
      },
      "FILE");
}

}  // namespace shardlab::cli
