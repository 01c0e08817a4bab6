// A fresh directory under the system's temporary one, removed with the object (also when a test fails or throws).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace shardlab::test_support {

/// A directory `<tmp>/shardlab-test-<name>-<pid>`, emptied on construction and removed on destruction.
struct TempDir {
  std::string path;  ///< its absolute path
  explicit TempDir(const std::string& name)
      : path((std::filesystem::temp_directory_path() / ("shardlab-test-" + name + "-" + std::to_string(::getpid())))
                 .string()) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// The path of `leaf` inside the directory.
  std::string operator/(const std::string& leaf) const { return path + "/" + leaf; }
};

}  // namespace shardlab::test_support
