// The test tool_cli_errors' way into `shardlab`: its command line, many times over in one process, so libtorch loads
// once rather than once per refused flag (tests/tools/test_cli.py, shardlab_batch.py).
//
//   shardlab_cli_batch --batch   reads one JSON array of arguments per line of stdin (what follows `shardlab`) and
//                                answers each with one line on stdout: {"index": its line's number from 0, "code": exit
//                                code, "output": what it wrote to stdout and stderr, in the order written}. Before
//                                each command it names it on stderr, which the caller leaves uncaptured: a command
//                                that hangs is named in the test's log.
//   shardlab_cli_batch ARGS...   exactly `shardlab ARGS...` (a command that gets past its checks starts its ranks as
//                                this program, and they run as shardlab's would)
#include "cli.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void flush_all() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(stdout);
  std::fflush(stderr);
}

// A copy of `fd` that a process started meanwhile (a rank) does not inherit.
int keep(int fd) {
  const int copy = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (copy < 0) throw std::runtime_error("shardlab_cli_batch: cannot duplicate descriptor " + std::to_string(fd));
  return copy;
}

void point(int from, int to) {
  if (dup2(from, to) < 0)
    throw std::runtime_error("shardlab_cli_batch: cannot redirect descriptor " + std::to_string(to));
}

// Runs shardlab's command line on `args` with stdout and stderr sent to one temporary file (close-on-exec) and the
// streams' formatting put back after it; returns its exit code (-1: it threw, the exception's message is the last line
// of `output`) and fills `output` with that file.
int run_captured(std::vector<std::string> words, std::string& output) {
  words.insert(words.begin(), "shardlab");
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);

  const char* tmp = std::getenv("TMPDIR");
  std::string path = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/shardlab_cli_batch.XXXXXX";
  const int fd = mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("shardlab_cli_batch: cannot make a temporary file in " + path);
  std::ios out_format(nullptr), err_format(nullptr);
  out_format.copyfmt(std::cout);
  err_format.copyfmt(std::cerr);
  flush_all();
  const int saved_out = keep(1), saved_err = keep(2);
  point(fd, 1);
  point(fd, 2);
  int code = -1;
  std::string thrown;
  try {
    code = shardlab::cli::shardlab_main(static_cast<int>(words.size()), argv.data());
  } catch (const std::exception& e) {
    thrown = std::string("shardlab_cli_batch: shardlab_main threw: ") + e.what() + "\n";
  } catch (...) {
    thrown = "shardlab_cli_batch: shardlab_main threw something that is no std::exception\n";
  }
  flush_all();
  point(saved_out, 1);
  point(saved_err, 2);
  close(saved_out);
  close(saved_err);
  close(fd);
  std::cout.copyfmt(out_format);
  std::cerr.copyfmt(err_format);
  std::cout.clear();
  std::cerr.clear();
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  output = text.str() + thrown;
  unlink(path.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || std::string(argv[1]) != "--batch") return shardlab::cli::shardlab_main(argc, argv);
  std::string line;
  for (int index = 0; std::getline(std::cin, line); ++index) {
    const auto args = nlohmann::json::parse(line).get<std::vector<std::string>>();
    std::string named;
    for (const auto& a : args) named += " " + a;
    std::cerr << "shardlab_cli_batch: " << index << ":" << named << std::endl;
    std::string output;
    const int code = run_captured(args, output);
    std::cout << nlohmann::json{{"index", index}, {"code", code}, {"output", output}}.dump(
                     -1, ' ', false, nlohmann::json::error_handler_t::replace)
              << std::endl;
  }
  return 0;
}
