// The run options written out (options.h), from the option table (option_table.h): as a worker's command line
// (to_args) and as the TOML a config file holds (config_toml), which CLI11 writes from the same flags.
#include "options.h"

#include "option_table.h"
#include "strategies.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardlab::cli {
namespace {

// The options in force as flags, from the option table: those written everywhere, and those written only to
// `only` (the worker's command line, or the config file). A flag of what the strategy cannot do is left out (its
// worker would refuse it, as train does).
std::vector<std::string> written_args(const RunOptions& o, RunOption::Written only) {
  const Capabilities can = capabilities_of(o.strategy);
  std::vector<std::string> args;
  for (const RunOption& option : run_option_table()) {
    if (option.written != RunOption::Written::kEverywhere && option.written != only) continue;
    if (option.needs != nullptr && !(can.*option.needs)) continue;
    for (const std::string& value : option.values(o)) args.insert(args.end(), {option.flag, value});
  }
  return args;
}

// `app`'s subcommand "train" with the run options, bound to `o`: the table a config file's keys are read from.
CLI::App* add_run_options_command(CLI::App& app, RunOptions& o) {
  CLI::App* train = app.add_subcommand("train");
  add_run_options(*train, o, /*strategy=*/true);
  return train;
}

}  // namespace

std::string config_toml(const RunOptions& o) {
  // The table's options as written to a config file are complete by construction (the worker's command line is the
  // same, with --result-dir and without --timeout, and a worker runs on it alone): every option in force, derived
  // ones included (the world size a mesh sets). Parsed as train's command line, CLI11 writes exactly those options
  // in its own TOML (a flag given twice, --bucket-cap-kb 32 --bucket-cap-kb auto, is an array), and reads it back.
  std::vector<std::string> args = written_args(o, RunOption::Written::kConfig);
  args.insert(args.begin(), "train");
  CLI::App app{"", "shardlab"};
  RunOptions parsed = default_run_options();
  add_run_options_command(app, parsed);
  std::reverse(args.begin(), args.end());  // CLI11 takes a vector last argument first
  app.parse(args);
  return app.config_to_str(/*default_also=*/false, /*write_description=*/false);
}

RunOptions read_config_file(const std::string& path) {
  CLI::App app{"", "shardlab"};
  app.allow_config_extras(CLI::config_extras_mode::error);  // as train's: a key no option takes is refused
  RunOptions o = default_run_options();
  CLI::App* train = add_run_options_command(app, o);
  app.set_config("--config");
  train->fallthrough();
  app.parse(std::vector<std::string>{path, "--config", "train"});  // CLI11 takes a vector last argument first
  return o;
}

void check_config_writable(const RunOptions& o) {
  const std::vector<std::string> args = to_args(o);
  for (size_t i = 0; i + 1 < args.size(); i += 2)
    if (args[i + 1].find_first_of("#\\\n\"'") != std::string::npos)
      throw std::invalid_argument("--write-config cannot write " + args[i] + " '" + args[i + 1] +
                                  "': a config file's value may not hold '#', '\\', a quote or a line break (CLI11 2.1 "
                                  "reads them back wrongly); choose another");
}

std::vector<std::string> to_args(const RunOptions& o) { return written_args(o, RunOption::Written::kWorker); }

}  // namespace shardlab::cli
