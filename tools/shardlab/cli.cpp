// shardlab: train a model on N local ranks with a chosen strategy and compare it with one device.
//   shardlab train --strategy naive_ddp --world-size 4 --model tiny_gpt --steps 10 [--json FILE]
//   shardlab train --config run.toml           (written by --write-config: the same run again)
//   shardlab compare --world-size 4 --model tiny_gpt
//   shardlab bench --out docs/benchmark
//   shardlab export DIR model.safetensors
// The command line is CLI11's: subcommands, --help for each, validators; a usage error exits with 2.
#include "cli.h"

#include "bench.h"

#include "../cli_validators.h"
#include "options.h"
#include "run.h"
#include "strategies.h"

#include "shardlab/core/checkpoint/checkpoint.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>

using namespace shardlab::cli;

namespace {

std::string strategy_list() {
  std::string out;
  for (const auto& s : strategies())
    out += "\n  " + s.name + std::string(20 - std::min<size_t>(19, s.name.size()), ' ') + s.description;
  return out;
}

int train(const RunOptions& o, const std::string& self) {
  RunReport r = run_strategy(o, self);
  print_report(r);
  if (!o.json.empty()) write_json(o.json, {r}, false);
  return 0;
}

int compare(const RunOptions& o, const std::string& self) {
  std::vector<RunReport> reports;
  for (const auto& s : strategies()) {
    if (o.train.clip_norm > 0 && !s.can.clips()) {
      std::cout << "compare: " << s.name << " left out: it cannot clip (--clip-norm)\n";
      continue;
    }
    if (s.can.mesh && mesh_shape(o.strategy_options, o.world_size).second < 2) {
      std::cout << "compare: " << s.name << " left out: it shards over 2 or more ranks per replica (--world-size, "
                << "--mesh)\n";
      continue;
    }
    RunOptions each = o;
    each.strategy = s.name;
    each.world_size = s.can.communicates ? o.world_size : 1;
    each.config = config_toml(each);  // the row's run again: shardlab train --config
    reports.push_back(run_strategy(each, self));
  }
  print_comparison(reports);
  if (!o.json.empty()) write_json(o.json, reports, true);
  return 0;
}

int export_file(const std::string& dir, const std::string& file) {
  const shardlab::CheckpointIndex index = shardlab::read_checkpoint_index(dir);
  shardlab::export_checkpoint(dir, file);
  size_t model_tensors = 0;
  for (const auto& [name, saved] : index.tensors) model_tensors += name.rfind("optim.", 0) != 0;
  std::cout << "shardlab export: " << model_tensors << " tensors of '" << dir << "' (saved by " << index.world_size
            << " ranks; every piece checked against its CRC-32) written to '" << file << "'\n";
  return 0;
}

}  // namespace

int shardlab::cli::shardlab_main(int argc, char** argv) {
  CLI::App app{"shardlab: data parallelism from scratch on libtorch and c10d, every run checked against one device",
               "shardlab"};
  app.require_subcommand(1, 1);
  // A key of a config file that no option has is an error, not a silent default (a typo would change the run).
  // Set before the subcommands are added: they inherit it.
  app.allow_config_extras(CLI::config_extras_mode::error);

  RunOptions train_o = default_run_options();
  CLI::App* train_cmd = app.add_subcommand("train", "train on N local ranks with a strategy, beside one device");
  add_run_options(*train_cmd, train_o, /*strategy=*/true);
  // --config is the app's (CLI11 reads a subcommand's options from its table, train.steps = 3); train passes it up.
  const char* config_help =
      "train: read the options from FILE (TOML, as --write-config writes it); a flag typed too wins";
  CLI::Option* config = app.set_config("--config", "", config_help)->configurable(false)->type_name("FILE");
  config->check(CLI::Validator([](std::string& v) { return v.empty() ? "expects a TOML file; got ''" : ""; }, "FILE"));
  train_cmd->fallthrough();
  // The flags typed on the command line: CLI11 calls this once train's arguments are parsed, before it reads the
  // --config file (whose values count as given too), so the checks can let a typed flag win over the file's.
  std::set<std::string> train_typed;
  train_cmd->parse_complete_callback([&] { train_typed = given_flags(*train_cmd); });
  std::string write_config;
  train_cmd->add_option("--write-config", write_config, "write every option in force to FILE (TOML) and train")
      ->configurable(false)
      ->check(file_to_write("a file to write"));
  train_cmd->footer("Strategies:" + strategy_list() + "\n\n--config FILE (shardlab --help): " + config_help);

  RunOptions compare_o = default_run_options();
  CLI::App* compare_cmd = app.add_subcommand("compare", "every strategy side by side on the same run");
  add_run_options(*compare_cmd, compare_o, /*strategy=*/false);

  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "step time, traffic and overlap of every strategy beside PyTorch's DDP and FSDP2 (PREFIX.json/.md)");
  BenchFlags bench_flags;
  add_bench_options(*bench_cmd, bench_flags);

  std::string export_dir, export_to;
  CLI::App* export_cmd = app.add_subcommand("export", "a checkpoint (--save DIR) as one safetensors file");
  export_cmd->add_option("DIR", export_dir, "the checkpoint's directory (train --save DIR)")
      ->required()
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            const std::string problem = checkpoint_problem(v, /*weights_file=*/false);
            return problem.empty() ? ""
                                   : "expects a checkpoint's directory (train --save DIR); got '" + v + "', " + problem;
          },
          "DIR"));
  export_cmd->add_option("FILE", export_to, "the safetensors file to write")
      ->required()
      ->check(file_to_write("a file to write"));

  // One rank of a run: train launches them; on several machines a launcher per machine does (README).
  RunOptions worker_o = default_run_options();
  CLI::App* worker_cmd = app.add_subcommand(
      "worker",
      "one rank of train, started by a launcher (shardlab-run, torchrun) on each machine; writes its results "
      "to --result-dir");
  add_run_options(*worker_cmd, worker_o, /*strategy=*/true, /*worker=*/true);
  // Its options from a config file instead (train --write-config's): on several machines, one file for every rank.
  std::string worker_config;
  worker_cmd
      ->add_option("--config", worker_config,
                   "read every run option from FILE (TOML, as train --write-config writes it); only --result-dir "
                   "may be typed beside it")
      ->type_name("FILE")
      ->check(CLI::ExistingFile);
  // Hidden: one rank of the ring benchmark.
  CLI::App* probe_cmd = app.add_subcommand("rs-probe", "one rank of bench --section reduce_scatter")->group("");
  std::string probe_out;
  int probe_rounds = 3;
  probe_cmd->add_option("--out", probe_out, "rank 0 writes the figures there")->required();
  probe_cmd->add_option("--repeat", probe_rounds, "rounds")->check(CLI::Range(1, 20));
  app.footer("Run `shardlab COMMAND --help` for a command's options.");  // after the commands: theirs is their own
  // A config file holds train's options only: another command's key is refused, naming it.
  for (CLI::App* cmd : {compare_cmd, bench_cmd, export_cmd, worker_cmd, probe_cmd})
    for (CLI::Option* opt : cmd->get_options()) opt->configurable(false);

  try {
    // A first word that is no command: said in the tool's words, with the commands.
    if (argc == 2 && std::string(argv[1]) == "help") {  // as git and cargo: the same as --help
      std::cout << app.help();
      return 0;
    }
    const auto commands = app.get_subcommands([](const CLI::App*) { return true; });
    if (argc > 1 && argv[1][0] != '-' &&
        std::none_of(commands.begin(), commands.end(), [&](const CLI::App* c) { return c->get_name() == argv[1]; })) {
      std::string names;
      for (const CLI::App* c : commands)
        if (!c->get_group().empty()) names += (names.empty() ? "" : ", ") + c->get_name();
      throw CLI::ValidationError("unknown command '" + std::string(argv[1]) + "'; expected one of " + names +
                                 " (shardlab --help)");
    }
    app.parse(argc, argv);
    if (config->count() > 0 && !*train_cmd)
      throw CLI::ValidationError("--config", "reads the options of shardlab train; got it with shardlab " +
                                                 app.get_subcommands().front()->get_name());
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    if (*worker_cmd) {
      std::set<std::string> typed = given_flags(*worker_cmd);
      if (worker_config.empty()) return run_worker(check_run_options(typed, worker_o, true));
      typed.erase("--config");
      typed.erase("--result-dir");
      if (!typed.empty())
        throw std::invalid_argument("worker --config takes every run option from the file; got " + *typed.begin() +
                                    " too (write it into the file: shardlab train ... --write-config FILE)");
      RunOptions o = read_config_file(worker_config);
      o.result_dir = worker_o.result_dir;
      return run_worker(check_run_options({}, o, true));
    }
    if (*probe_cmd) return run_rs_probe(probe_out, probe_rounds);
    if (*train_cmd) {
      RunOptions o = check_run_options(train_typed, train_o, true);
      o.config = config_toml(o);
      if (!write_config.empty()) {
        check_config_writable(o);
        std::ofstream out(write_config);
        out << "# shardlab train: every option in force; run it again with shardlab train --config FILE\n" << o.config;
        if (!out) throw std::invalid_argument("--write-config expects a file it can write; got '" + write_config + "'");
      }
      return train(o, self);
    }
    if (*compare_cmd) return compare(check_run_options(given_flags(*compare_cmd), compare_o, false), self);
    if (*bench_cmd) return run_bench(bench_flags, bench_cmd->remaining(), self);
    if (*export_cmd) return export_file(export_dir, export_to);
    return 2;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    const std::string what = e.what(), extra = "INI was not able to parse ";
    std::string line;                 // written at once (see below)
    if (e.get_name() == "FileError")  // CLI11 says "F was not readable (missing?)"; name the flag too
      line = "shardlab: --config expects a readable TOML file; " + what + "\n";
    else if (e.get_name() == "ConfigError" && what.rfind(extra, 0) == 0)  // a key of the file that no option has
      line = "shardlab: --config: the file sets '" + what.substr(extra.size()) +
             "', which no option takes (the options of shardlab train --help, in its table: train.steps = 3, as "
             "--write-config writes them)\n";
    else
      line = "shardlab: " + what + "\n";
    std::cerr << line;
    if (e.get_name() == "RequiredError" && app.get_subcommands().empty()) std::cerr << app.help();
    return 2;
  } catch (const std::invalid_argument& e) {
    // One write: a rank the launcher kills while it reports says all of its line or none of it.
    std::cerr << ("shardlab: " + std::string(e.what()) + "\n");
    return 2;
  } catch (const std::exception& e) {
    std::cerr << ("shardlab: " + std::string(e.what()) + "\n");
    return 1;
  }
}
