/// @file test_launcher.cpp
/// Tests of launch() and pick_free_port(): environment per rank, output lines, fail-fast, timeout, no orphans.
/// Ranks are /bin/sh one-liners; the "killed fast" checks use a generous 15 s bound as a hang guard only.

#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardlab/common/launcher.h"

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

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void print_result(const LaunchResult& r, double seconds) {
  std::cout << "exit_code=" << r.exit_code << " failed_rank=" << r.failed_rank << " message='" << r.message
            << "' elapsed=" << seconds << " s\n";
}

TEST(Launcher, EveryRankSeesItsOwnEnvironment) {
  LaunchOptions options;
  options.nproc = 4;
  options.master_port = 29517;
  options.extra_env = {{"SHARDLAB_TEST", "hello"}};
  Collector out;
  const LaunchResult r = launch(options,
                                sh("echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE "
                                   "addr=$MASTER_ADDR port=$MASTER_PORT group=$GROUP_RANK extra=$SHARDLAB_TEST"),
                                out.sink());
  print_result(r, 0);
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
  LaunchOptions options;
  options.nproc = 3;
  Collector out;
  const LaunchResult r = launch(options, sh("echo $MASTER_PORT"), out.sink());
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
  LaunchOptions options;
  options.nproc = 1;
  Collector out;
  const LaunchResult r = launch(options, sh("echo one; echo two >&2; echo; printf 'no newline'"), out.sink());
  EXPECT_EQ(r.exit_code, 0) << r.message;
  const std::vector<Line> expected = {{0, "one"}, {0, "two"}, {0, ""}, {0, "no newline"}};
  std::cout << "got " << out.lines.size() << " lines\n";
  EXPECT_EQ(out.lines, expected);
}

TEST(Launcher, FailingRankIsNamedAndOthersAreKilledFast) {
  LaunchOptions options;
  options.nproc = 4;
  Collector out;
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r =
      launch(options, sh("if [ \"$RANK\" = 1 ]; then sleep 0.2; echo failing; exit 3; fi; sleep 30"), out.sink());
  const double elapsed = seconds_since(start);
  print_result(r, elapsed);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.message, "rank 1 exited with code 3");
  EXPECT_LT(elapsed, 15.0);
  EXPECT_EQ(out.lines, (std::vector<Line>{{1, "failing"}}));
}

TEST(Launcher, RankKilledBySignalIsNamed) {
  LaunchOptions options;
  options.nproc = 2;
  Collector out;
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r = launch(options, sh("if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 30"), out.sink());
  print_result(r, seconds_since(start));
  EXPECT_EQ(r.exit_code, 128 + 9);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.message, "rank 1 killed by signal 9");
  EXPECT_LT(seconds_since(start), 15.0);
}

TEST(Launcher, TimeoutNamesEveryRankStillRunning) {
  LaunchOptions options;
  options.nproc = 3;
  options.timeout = std::chrono::milliseconds(500);
  Collector out;
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r = launch(options, sh("sleep 30"), out.sink());
  const double elapsed = seconds_since(start);
  print_result(r, elapsed);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(r.message, "timeout after 0.5 s: ranks 0, 1, 2 still running");
  EXPECT_GE(elapsed, 0.5);
  EXPECT_LT(elapsed, 15.0);
}

TEST(Launcher, TimeoutNamesTheLowestRankStillRunning) {
  LaunchOptions options;
  options.nproc = 3;
  options.timeout = std::chrono::milliseconds(1000);
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r = launch(options, sh("if [ \"$RANK\" = 2 ]; then sleep 30; fi"), print_prefixed);
  print_result(r, seconds_since(start));
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_EQ(r.failed_rank, 2);
  EXPECT_EQ(r.message, "timeout after 1 s: rank 2 still running");
}

TEST(Launcher, UnknownProgramExits127WithMessage) {
  LaunchOptions options;
  options.nproc = 1;
  Collector out;
  const LaunchResult r = launch(options, {"/nonexistent/shardlab-prog", "x"}, out.sink());
  print_result(r, 0);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_EQ(r.failed_rank, 0);
  EXPECT_EQ(
      out.lines,
      (std::vector<Line>{{0, "shardlab-run: cannot execute /nonexistent/shardlab-prog: No such file or directory"}}));
}

#ifdef __linux__
/// True while `pid` exists and is not a zombie.
bool alive(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] != 'Z';
}

/// True if `pid` is still alive after up to 2 s (a SIGKILLed process takes a moment to go).
bool survives(int pid) {
  for (int i = 0; i < 200 && alive(pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return alive(pid);
}

TEST(Launcher, NoGrandchildSurvivesAFailedLaunch) {
  LaunchOptions options;
  options.nproc = 2;
  Collector out;
  // Every rank starts a background sleep and prints its pid; rank 0 then fails.
  const LaunchResult r =
      launch(options, sh("sleep 30 & echo $!; if [ \"$RANK\" = 0 ]; then sleep 0.2; exit 1; fi; wait"), out.sink());
  print_result(r, 0);
  EXPECT_EQ(r.failed_rank, 0);
  ASSERT_EQ(out.lines.size(), 2u);
  for (const auto& line : out.lines) {
    const int pid = std::stoi(line.second);
    const bool survived = survives(pid);
    std::cout << "rank " << line.first << "'s background sleep " << pid << " survived=" << survived << "\n";
    EXPECT_FALSE(survived) << "pid " << pid << " of rank " << line.first;
  }
}

TEST(Launcher, ExceptionFromSinkKillsEveryRank) {
  LaunchOptions options;
  options.nproc = 2;
  std::vector<int> pids;
  const LineSink throwing = [&pids](int, const std::string& line) {
    pids.push_back(std::stoi(line));
    throw std::runtime_error("sink failed");
  };
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(launch(options, sh("echo $$; exec sleep 30"), throwing), std::runtime_error);
  std::cout << "launch threw after " << seconds_since(start) << " s\n";
  EXPECT_LT(seconds_since(start), 15.0);
  ASSERT_EQ(pids.size(), 1u);
  EXPECT_FALSE(survives(pids[0])) << "rank process " << pids[0];
}
#endif

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
