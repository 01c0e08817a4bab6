// The test tool_cli_errors' way into `shardlab`: its command line, many times over in one process, so libtorch loads
// once rather than once per refused flag (tests/tools/test_cli.py).
//
//   shardlab_cli_batch --batch   reads one JSON array of arguments per line of stdin (what follows `shardlab`) and
//                                answers each with one line: {"code": exit code, "output": what it wrote to stdout
//                                and stderr, in the order written}
//   shardlab_cli_batch ARGS...   exactly `shardlab ARGS...` (a command that gets past its checks starts its ranks as
//                                this program, and they run as shardlab's would)
#include "cli.h"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

void flush_all() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(stdout);
  std::fflush(stderr);
}

// Runs shardlab's command line on `args` with stdout and stderr sent to one temporary file; returns its exit code
// and fills `output` with that file.
int run_captured(const std::vector<std::string>& args, std::string& output) {
  std::vector<std::string> words{"shardlab"};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);

  char path[] = "/tmp/shardlab_cli_batch.XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) throw std::runtime_error("shardlab_cli_batch: cannot make a temporary file");
  flush_all();
  const int saved_out = dup(1), saved_err = dup(2);
  dup2(fd, 1);
  dup2(fd, 2);
  int code = 0;
  try {
    code = shardlab::cli::shardlab_main(static_cast<int>(words.size()), argv.data());
  } catch (...) {
    flush_all();
    dup2(saved_out, 1);
    dup2(saved_err, 2);
    throw;
  }
  flush_all();
  dup2(saved_out, 1);
  dup2(saved_err, 2);
  close(saved_out);
  close(saved_err);
  close(fd);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  output = text.str();
  unlink(path);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]) != "--batch") return shardlab::cli::shardlab_main(argc, argv);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    const auto args = nlohmann::json::parse(line).get<std::vector<std::string>>();
    std::string output;
    const int code = run_captured(args, output);
    std::cout << nlohmann::json{{"code", code}, {"output", output}}.dump(-1, ' ', false,
                                                                         nlohmann::json::error_handler_t::replace)
              << std::endl;
  }
  return 0;
}
