// Staging directories and files put in place: the crash safety of every save. A checkpoint is never written where
// it will be read: a sharded save fills a staging directory `<dir>.shardlab-partial` and exchanges it with `<dir>`
// in one step (renameat2), a full file is written as `<file>.shardlab-partial` and renamed onto `<file>`; each is
// flushed to the disk before it is put in place, and a staging file not put in place is removed. Here are those
// steps, and the checks that a save will not replace what is not a checkpoint (Note [Saving so that nothing is
// lost] in checkpoint.cpp says how a save uses them).

#include "shardlab/core/checkpoint/checkpoint.h"

#include "detail/checkpoint_internal.h"

#include "shardlab/core/errors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

namespace shardlab {

namespace fs = std::filesystem;

namespace {

std::string parent_of(const std::string& path) {
  const fs::path p = fs::absolute(fs::path(path)).parent_path();
  return p.empty() ? "." : p.string();
}

}  // namespace

void detail::fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open '" + path + "' to flush it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw std::runtime_error("cannot flush '" + path + "': " + std::strerror(errno));
}

void detail::write_text_file(const std::string& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw std::runtime_error("cannot write '" + path + "'");
  }
  fsync_path(path, false);
}

std::string detail::without_trailing_slash(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// Puts `staging` where `dir` is, in one step where the filesystem can (Note [Saving so that nothing is lost]).
void detail::swap_into_place(const std::string& staging, const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    if (::rename(staging.c_str(), dir.c_str()) != 0)
      throw std::runtime_error("cannot rename '" + staging + "' to '" + dir + "': " + std::strerror(errno));
  } else if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(staging, ec);  // the previous checkpoint
  } else {
    const std::string old = dir + kOldSuffix;
    fs::remove_all(old, ec);
    if (::rename(dir.c_str(), old.c_str()) != 0 || ::rename(staging.c_str(), dir.c_str()) != 0)
      throw std::runtime_error("cannot put '" + staging + "' in place of '" + dir + "': " + std::strerror(errno));
  }
  fs::remove_all(dir + kOldSuffix, ec);  // the fallback's, or a stale one from a save killed in it: never loaded again
  try {  // the swap is done: a failure to flush the parent must not report the save as failed
    fsync_path(parent_of(dir), true);
  } catch (const std::exception& e) {
    warn_once("checkpoint.fsync_parent", std::string("save_checkpoint: ") + e.what() +
                                             "; the checkpoint is in place, but a power loss now may undo the rename");
  }
}

// Rank 0, step 1: a fresh staging directory; `dir` must be a checkpoint or absent.
void detail::prepare_staging(const std::string& dir, const std::string& staging) {
  std::error_code ec;
  if (const std::string file = file_in_the_way(dir); !file.empty())
    throw std::invalid_argument("cannot save a checkpoint into '" + dir + "': '" + file +
                                "' is a file, not a directory");
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec))
      throw std::invalid_argument("'" + dir + "' exists and is not a directory; not replacing it");
    if (!fs::exists(fs::path(dir) / kIndexName, ec) && !fs::is_empty(dir, ec))
      throw std::invalid_argument("'" + dir + "' is a directory with no " + kIndexName +
                                  ": not a shardlab checkpoint, so not replacing it (choose another directory)");
  }
  fs::remove_all(staging, ec);
  fs::create_directories(staging);
}

// Renames a finished staging file onto `file` and flushes the directory.
void detail::put_in_place(const std::string& partial, const std::string& file) {
  if (::rename(partial.c_str(), file.c_str()) != 0)
    throw std::runtime_error("cannot rename '" + partial + "' to '" + file + "': " + std::strerror(errno));
  try {  // the file is in place: a failure to flush its directory must not report the save as failed
    fsync_path(parent_of(file), true);
  } catch (const std::exception& e) {
    warn_once("checkpoint.fsync_file_parent", std::string("full file: ") + e.what() +
                                                  "; the file is in place, but a power loss now may undo the rename");
  }
}

detail::StagingFile::~StagingFile() {
  if (placed) return;
  std::error_code ec;
  fs::remove(path, ec);
}

std::string file_in_the_way(const std::string& dir) {
  std::error_code ec;
  for (fs::path p = fs::absolute(dir, ec).parent_path(); !p.empty(); p = p.parent_path()) {
    if (fs::exists(p, ec)) return fs::is_directory(p, ec) ? "" : p.string();
    if (p == p.root_path()) break;
  }
  return "";
}

}  // namespace shardlab
