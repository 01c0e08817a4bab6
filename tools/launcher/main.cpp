/// @file main.cpp
/// `shardlab-run`: starts N local ranks of a program, torchrun style. See shardlab/common/launcher.h.
///
///   shardlab-run -n N [--nnodes M --node-rank K --master-addr A] [--master-port P] [--timeout SECONDS]
///                -- program args...
///
/// Exit status: 0 when every rank exited 0; the failing rank's code (128+signal if it was killed, 124 on timeout,
/// 127 if the program cannot be executed); 2 for bad command-line flags.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "shardlab/common/launcher.h"
#include "shardlab/common/numbers.h"

namespace {

constexpr const char* kUsage =
    "usage: shardlab-run -n N [--nnodes M --node-rank K --master-addr A --master-port P] [--timeout SECONDS] -- "
    "program args...";

/// A command-line mistake: what was expected and what came.
struct UsageError {
  std::string message;
};

struct Args {
  shardlab::LaunchOptions options;
  std::vector<std::string> program;
  bool help = false;
};

long parse_int(const std::string& flag, const char* text, long lo, long hi, const std::string& expected) {
  const std::optional<int64_t> value = shardlab::parse_integer(text, lo, hi);
  if (!value) throw UsageError{"expected " + expected + " after " + flag + ", got '" + text + "'"};
  return static_cast<long>(*value);
}

double parse_seconds(const std::string& flag, const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value) || value <= 0 || value > 1e9) {
    throw UsageError{"expected a positive number of seconds after " + flag + ", got '" + text + "'"};
  }
  return value;
}

Args parse(int argc, char** argv) {
  Args args;
  bool have_n = false;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--") break;
    if (flag == "-h" || flag == "--help") {
      args.help = true;
      return args;
    }
    const bool takes_value = flag == "-n" || flag == "--nproc-per-node" || flag == "--nnodes" ||
                             flag == "--node-rank" || flag == "--master-addr" || flag == "--master-port" ||
                             flag == "--timeout";
    if (!takes_value) {
      throw UsageError{flag.rfind('-', 0) == 0 ? "unknown flag '" + flag +
                                                     "'; expected -n (--nproc-per-node), --nnodes, --node-rank, "
                                                     "--master-addr, --master-port, --timeout, --help or --"
                                               : "expected '--' before the program, got '" + flag + "'"};
    }
    if (i + 1 >= argc) throw UsageError{"expected a value after " + flag + ", got end of arguments"};
    const char* value = argv[++i];
    if (flag == "-n" || flag == "--nproc-per-node") {
      args.options.nproc = static_cast<int>(parse_int(flag, value, 1, 4096, "a number of ranks in 1..4096"));
      have_n = true;
    } else if (flag == "--nnodes") {
      args.options.nnodes = static_cast<int>(parse_int(flag, value, 1, 4096, "a number of nodes in 1..4096"));
    } else if (flag == "--node-rank") {
      args.options.node_rank = static_cast<int>(parse_int(flag, value, 0, 4095, "a node rank in 0..4095"));
    } else if (flag == "--master-addr") {
      if (*value == '\0') throw UsageError{"expected a host name or address after --master-addr, got ''"};
      args.options.master_addr = value;
    } else if (flag == "--master-port") {
      args.options.master_port = static_cast<int>(parse_int(flag, value, 1, 65535, "a port in 1..65535"));
    } else {
      args.options.timeout = std::chrono::milliseconds(std::max(1LL, std::llround(parse_seconds(flag, value) * 1000)));
    }
  }
  if (!have_n) throw UsageError{"expected -n N (the number of ranks), got no -n"};
  if (args.options.node_rank >= args.options.nnodes)
    throw UsageError{"expected --node-rank in 0.." + std::to_string(args.options.nnodes - 1) + " (--nnodes " +
                     std::to_string(args.options.nnodes) + "), got " + std::to_string(args.options.node_rank)};
  if (args.options.nnodes > 1 && args.options.master_port == 0)
    throw UsageError{"expected --master-port with --nnodes " + std::to_string(args.options.nnodes) +
                     " (every node must use the same port), got none"};
  if (i >= argc) throw UsageError{"expected '--' followed by the program, got end of arguments"};
  if (i + 1 >= argc) throw UsageError{"expected a program after '--', got nothing"};
  args.program.assign(argv + i + 1, argv + argc);
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "shardlab-run: " << e.message << "\n" << kUsage << "\n";
    return 2;
  }
  if (args.help) {
    std::cout << kUsage << "\n"
              << "  -n N               number of ranks (processes) to start on this node, >= 1 (--nproc-per-node)\n"
              << "  --nnodes M         number of nodes (machines), one shardlab-run on each (default: 1)\n"
              << "  --node-rank K      this node's index in 0..M-1: its ranks are K*N .. K*N+N-1 (default: 0)\n"
              << "  --master-addr A    host of rank 0's store, reachable from every node (default: 127.0.0.1)\n"
              << "  --master-port P    MASTER_PORT for every rank (default: a free port; required with --nnodes)\n"
              << "  --timeout SECONDS  kill every rank after this long (default: 600); exit code 124\n"
              << "Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and\n"
              << "GROUP_RANK (the node rank), as torchrun sets them; its output is printed as '[rank R] line' with\n"
              << "R the global rank. When one rank fails the others on this node are killed; the other nodes' ranks\n"
              << "fail by their collectives' timeout.\n";
    return 0;
  }
  try {
    const shardlab::LaunchResult result = shardlab::launch(args.options, args.program);
    if (result.exit_code != 0) std::cerr << "shardlab-run: " << result.message << "\n";
    return result.exit_code;
  } catch (const std::exception& e) {
    std::cerr << "shardlab-run: " << e.what() << "\n";
    return 1;
  }
}
