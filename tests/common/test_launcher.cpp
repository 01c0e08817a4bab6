/// @file test_launcher.cpp
/// Tests of launch() and pick_free_port(): environment per rank, output lines, fail-fast, timeout, no orphans.
/// Ranks are /bin/sh one-liners. No check reads a clock: ranks that must be killed block for longer than the
/// test's ctest TIMEOUT, so a launcher that waited for them instead hangs the test and ctest fails it; ranks order
/// their steps through files in a private directory (a rank fails only once the others are known to be running),
/// and since launch() reaps every process of every rank before it returns (Note [Reaping a rank's whole group]),
/// whatever must be dead is looked for at once.

#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shardlab/course/launcher.h"

namespace shardlab {
namespace {

using Line = std::pair<int, std::string>;

/// Collects (rank, line) pairs and echoes them, so a failing test shows what the ranks said.
struct Collector {
  std::vector<Line> lines;
  LineSink sink() {
    return [this](int rank, const std::string& line) {
      std::cout << "  [rank " << rank << "] " << line << "\n";
      lines.emplace_back(rank, line);
    };
  }
};

std::vector<std::string> sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

/// LaunchOptions for `nproc` ranks, every other field at its default.
LaunchOptions ranks(int nproc) {
  LaunchOptions options;
  options.nproc = nproc;
  return options;
}

void print_result(const LaunchResult& r) {
  std::cout << "exit_code=" << r.exit_code << " failed_rank=" << r.failed_rank << " message='" << r.message << "'\n";
}

// Longer than any test's ctest TIMEOUT: a rank that sleeps this long ends only by being killed.
const std::string kForever = "sleep 100000";

/// A private directory the ranks of one launch order their steps through, given to them as $SYNC; removed at the
/// end of the test.
struct SyncDir {
  SyncDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "shardlab-launcher-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path = pattern;
  }
  ~SyncDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  SyncDir(const SyncDir&) = delete;
  SyncDir& operator=(const SyncDir&) = delete;
  std::pair<std::string, std::string> env() const { return {"SYNC", path}; }
  std::string path;
};

/// Shell: block until every file named in `names` exists in $SYNC.
std::string wait_for_files(const std::vector<std::string>& names) {
  std::string test;
  for (const auto& n : names) test += (test.empty() ? "" : " && ") + std::string("[ -e \"$SYNC/") + n + "\" ]";
  return "until " + test + "; do sleep 0.01; done; ";
}

/// launch() of `script` (sh -c) with `options` and a fresh SyncDir as $SYNC, every line into `out`; prints the
/// result and returns it (the directory goes once launch() has reaped every rank).
LaunchResult launch_synced(LaunchOptions options, const std::string& script, Collector& out) {
  SyncDir sync;
  options.extra_env.push_back(sync.env());
  const LaunchResult r = launch(options, sh(script), out.sink());
  print_result(r);
  return r;
}

TEST(Launcher, EveryRankSeesItsOwnEnvironment) {
  LaunchOptions options = ranks(4);
  options.master_port = 29517;
  options.extra_env = {{"SHARDLAB_TEST", "hello"}};
  Collector out;
  const LaunchResult r = launch(options,
                                sh("echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE "
                                   "addr=$MASTER_ADDR port=$MASTER_PORT group=$GROUP_RANK extra=$SHARDLAB_TEST"),
                                out.sink());
  print_result(r);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.failed_rank, -1);
  std::set<Line> expected;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string k = std::to_string(rank);
    expected.emplace(rank, "rank=" + k + " world=4 local=" + k + "/4 addr=127.0.0.1 port=29517 group=0 extra=hello");
  }
  EXPECT_EQ(out.lines.size(), 4u);
  EXPECT_EQ(std::set<Line>(out.lines.begin(), out.lines.end()), expected);
}

TEST(Launcher, PortZeroGivesEveryRankTheSameFreePort) {
  Collector out;
  const LaunchResult r = launch(ranks(3), sh("echo $MASTER_PORT"), out.sink());
  ASSERT_EQ(r.exit_code, 0) << r.message;
  ASSERT_EQ(out.lines.size(), 3u);
  std::set<std::string> ports;
  for (const auto& line : out.lines) ports.insert(line.second);
  std::cout << "ranks saw " << ports.size() << " distinct port(s): " << *ports.begin() << "\n";
  ASSERT_EQ(ports.size(), 1u);
  const int port = std::stoi(*ports.begin());
  EXPECT_GE(port, 1);
  EXPECT_LE(port, 65535);
}

TEST(Launcher, SplitsLinesMergesStderrAndFlushesPartialLastLine) {
  Collector out;
  const LaunchResult r = launch(ranks(1), sh("echo one; echo two >&2; echo; printf 'no newline'"), out.sink());
  EXPECT_EQ(r.exit_code, 0) << r.message;
  const std::vector<Line> expected = {{0, "one"}, {0, "two"}, {0, ""}, {0, "no newline"}};
  std::cout << "got " << out.lines.size() << " lines\n";
  EXPECT_EQ(out.lines, expected);
}

/// The pid each rank printed as its first line (rank -> pid).
std::map<int, int> pids_of(const std::vector<Line>& lines) {
  std::map<int, int> pids;
  for (const auto& [rank, line] : lines)
    if (!pids.count(rank) && !line.empty() && std::isdigit(static_cast<unsigned char>(line[0])))
      pids[rank] = std::stoi(line);
  return pids;
}

/// True while a process `pid` exists (a zombie included). launch() has reaped its ranks when it returns, so a rank
/// that still exists then was never killed; it is killed here so that a failing test leaves nothing behind.
bool still_exists(int pid) {
  if (kill(pid, 0) != 0) return false;
  kill(pid, SIGKILL);
  return true;
}

TEST(Launcher, FailingRankIsNamedAndTheOthersAreKilled) {
  // Ranks 0, 2, 3 print their pid, say they run, and block; rank 1 fails once all three run.
  Collector out;
  const LaunchResult r = launch_synced(ranks(4),
                                       "if [ \"$RANK\" = 1 ]; then " + wait_for_files({"0", "2", "3"}) +
                                           "echo failing; exit 3; fi; echo $$; touch \"$SYNC/$RANK\"; exec " + kForever,
                                       out);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.message, "rank 1 exited with code 3");
  const auto pids = pids_of(out.lines);
  EXPECT_EQ(pids.size(), 3u) << "ranks 0, 2 and 3 each print their pid";
  for (const auto& [rank, pid] : pids) EXPECT_FALSE(still_exists(pid)) << "rank " << rank << " (pid " << pid << ")";
  EXPECT_EQ(std::count(out.lines.begin(), out.lines.end(), Line{1, "failing"}), 1);
  EXPECT_EQ(out.lines.size(), 4u);
}

TEST(Launcher, RankKilledBySignalIsNamed) {
  Collector out;
  const LaunchResult r = launch_synced(ranks(2),
                                       "if [ \"$RANK\" = 1 ]; then " + wait_for_files({"0"}) +
                                           "kill -9 $$; fi; echo $$; touch \"$SYNC/0\"; exec " + kForever,
                                       out);
  EXPECT_EQ(r.exit_code, 128 + 9);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.message, "rank 1 killed by signal 9");
  const auto pids = pids_of(out.lines);
  ASSERT_EQ(pids.count(0), 1u) << "rank 0 prints its pid";
  EXPECT_FALSE(still_exists(pids.at(0))) << "rank 0 is killed, not waited for";
}

TEST(Launcher, TimeoutNamesEveryRankStillRunning) {
  LaunchOptions options = ranks(3);
  options.timeout = std::chrono::milliseconds(500);
  Collector out;
  const LaunchResult r = launch(options, sh("echo $$; exec " + kForever), out.sink());
  print_result(r);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.message, "timeout after 0.5 s: ranks 0, 1, 2 still running");
  for (const auto& [rank, pid] : pids_of(out.lines))
    EXPECT_FALSE(still_exists(pid)) << "rank " << rank << " (pid " << pid << ")";
}

TEST(Launcher, TimeoutNamesTheLowestRankStillRunning) {
  // Ranks 0 and 1 write their pid and exit; rank 2 waits until both are gone from /proc (reaped: launch() knows
  // they ended), says so, and blocks. A timeout after that line names rank 2 alone. A timeout that came first (a
  // machine too loaded to start three shells in 2 s) may name 0 or 1 as well: then only what holds either way is
  // checked, and the test says so.
  LaunchOptions options = ranks(3);
  options.timeout = std::chrono::milliseconds(2000);
  Collector out;
  const LaunchResult r = launch_synced(
      options,
      "if [ \"$RANK\" != 2 ]; then echo $$ > \"$SYNC/$RANK.tmp\"; mv \"$SYNC/$RANK.tmp\" \"$SYNC/$RANK\"; exit 0; "
      "fi; " +
          wait_for_files({"0", "1"}) +
          "for r in 0 1; do p=$(cat \"$SYNC/$r\"); while [ -e /proc/$p ]; do sleep 0.01; done; done; "
          "echo 0 and 1 are gone; exec " +
          kForever,
      out);
  EXPECT_EQ(r.exit_code, 124);
  const bool ordered = std::count(out.lines.begin(), out.lines.end(), Line{2, "0 and 1 are gone"}) == 1;
  if (ordered) {
    EXPECT_EQ(r.failed_rank, 2);
    EXPECT_EQ(r.message, "timeout after 2 s: rank 2 still running");
  } else {
    std::cout << "the timeout came before ranks 0 and 1 were reaped: checking only that rank 2 is named\n";
    EXPECT_NE(r.message.find("2 still running"), std::string::npos) << r.message;
  }
}

TEST(Launcher, UnknownProgramExits127WithMessage) {
  Collector out;
  const LaunchResult r = launch(ranks(1), {"/nonexistent/shardlab-prog", "x"}, out.sink());
  print_result(r);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(
      out.lines,
      (std::vector<Line>{{0, "shardlab-run: cannot execute /nonexistent/shardlab-prog: No such file or directory"}}));
}

#ifdef __linux__
TEST(Launcher, NoGrandchildSurvivesAFailedLaunch) {
  Collector out;
  // Every rank starts a background sleep and prints its pid; rank 0 fails once rank 1 has printed its own.
  const LaunchResult r = launch_synced(ranks(2),
                                       kForever + " & echo $!; if [ \"$RANK\" = 0 ]; then " + wait_for_files({"1"}) +
                                           "exit 1; fi; touch \"$SYNC/1\"; wait",
                                       out);
  EXPECT_EQ(r.failed_rank, 0);
  ASSERT_EQ(out.lines.size(), 2u);
  for (const auto& [rank, line] : out.lines) {
    const int pid = std::stoi(line);
    const bool survived = still_exists(pid);
    std::cout << "rank " << rank << "'s background sleep " << pid << " survived=" << survived << "\n";
    EXPECT_FALSE(survived) << "pid " << pid << " of rank " << rank;
  }
}
#endif

TEST(Launcher, ExceptionFromSinkKillsEveryRank) {
  std::vector<int> pids;
  const LineSink throwing = [&pids](int, const std::string& line) {
    pids.push_back(std::stoi(line));
    throw std::runtime_error("sink failed");
  };
  EXPECT_THROW(launch(ranks(2), sh("echo $$; exec " + kForever), throwing), std::runtime_error);
  ASSERT_EQ(pids.size(), 1u);
  EXPECT_FALSE(still_exists(pids[0])) << "rank process " << pids[0];
}

TEST(Launcher, InvalidArgumentsThrow) {
  LaunchOptions options;
  options.nproc = 0;
  try {
    launch(options, {"true"});
    ADD_FAILURE() << "nproc = 0 did not throw";
  } catch (const std::invalid_argument& e) {
    std::cout << "nproc=0: " << e.what() << "\n";
    EXPECT_NE(std::string(e.what()).find("got 0"), std::string::npos);
  }
  options.nproc = -3;
  EXPECT_THROW(launch(options, {"true"}), std::invalid_argument);
  options.nproc = 2;
  try {
    launch(options, {});
    ADD_FAILURE() << "empty argv did not throw";
  } catch (const std::invalid_argument& e) {
    std::cout << "empty argv: " << e.what() << "\n";
  }
  options.master_port = 70000;
  EXPECT_THROW(launch(options, {"true"}), std::invalid_argument);
}

TEST(Launcher, PickFreePortReturnsAValidPort) {
  const int port = pick_free_port();
  std::cout << "pick_free_port() = " << port << "\n";
  EXPECT_GE(port, 1);
  EXPECT_LE(port, 65535);
}

}  // namespace
}  // namespace shardlab
