#pragma once
// The run options of `shardlab train`, its worker, compare and bench, declared once: one entry per flag, from which
// come CLI11's registration (add_run_options), the worker's command line and the config file (to_args,
// config_toml), and the refusal of a flag that needs a capability the strategy lacks (check_run_options: --mesh,
// --defer-all-reduce, the prefetch flags). A new option is its field in RunOptions and one entry here; a check
// between flags or of a value's use (--bucket-cap-kb auto, --clip-norm, the checkpoints) stays in check_run_options.

#include "options.h"
#include "strategies.h"

#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace shardlab::cli {

/// One run option.
struct RunOption {
  /// Which commands take it.
  enum class Where {
    kEveryCommand,  ///< train, worker, compare, bench
    kStrategy,      ///< train and worker, which run one strategy (--strategy)
    kTrain,         ///< train and worker; compare and bench keep it hidden, only to refuse it in words
    kWorker,        ///< the worker only (--result-dir)
  };
  /// Where its value is written.
  enum class Written {
    kEverywhere,  ///< the worker's command line and the config file
    kConfig,      ///< the config file only (--timeout: the launcher's)
    kWorker,      ///< the worker's command line only (--result-dir)
    kNowhere,     ///< neither: an output of this invocation (--json)
  };
  std::string flag;  ///< "--steps"
  Where where = Where::kEveryCommand;
  Written written = Written::kEverywhere;
  /// The capability a strategy needs to take it (null: every strategy takes it). A strategy without it refuses it
  /// when typed, and its worker is never given it.
  bool Capabilities::*needs = nullptr;
  /// The refusal's words after the flag, "{}" standing for the strategies that take it ("applies to strategy {} only").
  std::string refusal;
  /// Registers it on `cmd`, bound to its field of `o`, with the validator that names what it expects and what came.
  std::function<CLI::Option*(CLI::App& cmd, RunOptions& o)> add;
  /// Its values in force, each written after the flag (none: not written; the reader's default is the value).
  std::function<std::vector<std::string>(const RunOptions& o)> values;
};

/// Every run option, in the order --help lists them.
const std::vector<RunOption>& run_option_table();

/// The refusal of `option` for `strategy`, which lacks option.needs: "--mesh applies to strategy hsdp only; got
/// strategy 'fsdp'".
std::string refusal_of(const RunOption& option, const std::string& strategy);

}  // namespace shardlab::cli
