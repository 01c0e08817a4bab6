/// @file main.cpp
/// `shardlab-run`: starts N local ranks of a program, torchrun style. See shardlab/course/launcher.h.
///
///   shardlab-run -n N [--nnodes M --node-rank K --master-addr A] [--master-port P] [--timeout SECONDS]
///                -- program args...
///
/// Exit status: 0 when every rank exited 0; the failing rank's code (128+signal if it was killed, 124 on timeout,
/// 127 if the program cannot be executed); 2 for bad command-line flags.

#include "shardlab/course/launcher.h"

#include "../cli_validators.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

using shardlab::cli::integer_in;

int main(int argc, char** argv) {
  CLI::App app{
      "shardlab-run: starts a program as N ranks on this node, with the environment torchrun gives "
      "(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK)",
      "shardlab-run"};
  shardlab::LaunchOptions options;
  std::vector<std::string> program;
  double timeout_s = 600;
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // a flag twice: the last
  app.add_option("-n,--nproc-per-node", options.nproc, "number of ranks (processes) to start on this node")
      ->transform(integer_in(1, 4096))
      ->required();
  app.add_option("--nnodes", options.nnodes, "number of nodes (machines), one shardlab-run on each")
      ->transform(integer_in(1, 4096))
      ->capture_default_str();
  app.add_option("--node-rank", options.node_rank, "this node's index in 0..M-1: its ranks are K*N .. K*N+N-1")
      ->transform(integer_in(0, 4095))
      ->capture_default_str();
  app.add_option("--master-addr", options.master_addr, "host of rank 0's store, reachable from every node")
      ->check(CLI::Validator(
          [](std::string& v) { return v.empty() ? std::string("expected a host name or address, got ''") : ""; },
          "HOST"))
      ->capture_default_str();
  app.add_option("--master-port", options.master_port,
                 "MASTER_PORT for every rank (default: a free port; required with --nnodes)")
      ->transform(integer_in(1, 65535));
  app.add_option("--timeout", timeout_s, "kill every rank after this many seconds; exit code 124")
      ->check(shardlab::cli::positive_number())
      ->capture_default_str();
  app.add_option("program", program, "the program and its arguments, after --")->required();
  app.footer(
      "Each rank's output is printed as '[rank R] line' with R the global rank. When one rank fails the others on "
      "this node are killed; the other nodes' ranks fail by their collectives' timeout.");
  try {
    app.parse(argc, argv);
    char** const dash = std::find(argv + 1, argv + argc, std::string("--"));
    if (dash == argv + argc || program.size() != static_cast<size_t>(argv + argc - dash - 1))
      throw CLI::ValidationError("expected '--' followed by the program (shardlab-run -n N -- program args...)");
    if (options.node_rank >= options.nnodes)
      throw CLI::ValidationError("--node-rank", "expected --node-rank in 0.." + std::to_string(options.nnodes - 1) +
                                                    " (--nnodes " + std::to_string(options.nnodes) + "), got " +
                                                    std::to_string(options.node_rank));
    if (timeout_s > 1e9)  // a day is 86400 s; beyond 1e9 the milliseconds below would overflow
      throw CLI::ValidationError("--timeout", "expects at most 1e9 seconds; got " + std::to_string(timeout_s));
    if (options.nnodes > 1 && options.master_port == 0)
      throw CLI::ValidationError("--master-port", "expected --master-port with --nnodes " +
                                                      std::to_string(options.nnodes) +
                                                      " (every node must use the same port), got none");
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "shardlab-run: " << e.what() << "\n" << app.get_display_name() << ": see shardlab-run --help\n";
    return 2;
  }
  options.timeout = std::chrono::milliseconds(std::max(1LL, std::llround(timeout_s * 1000)));
  try {
    const shardlab::LaunchResult result = shardlab::launch(options, program);
    if (result.exit_code != 0) std::cerr << "shardlab-run: " << result.message << "\n";
    return result.exit_code;
  } catch (const std::exception& e) {
    std::cerr << "shardlab-run: " << e.what() << "\n";
    return 1;
  }
}
