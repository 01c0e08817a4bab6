// shardlab: train a model on N local ranks with a chosen strategy and compare it with one device.
//   shardlab train --strategy naive_ddp --world-size 4 --model tiny_gpt --steps 10 [--json FILE]
//   shardlab compare --world-size 4 --model tiny_gpt
//   shardlab bench --out docs/benchmark
//   shardlab export DIR model.safetensors
#include "bench.h"
#include "options.h"
#include "run.h"
#include "strategies.h"

#include "shardlab/common/checkpoint.h"

#include <filesystem>
#include <iostream>

using namespace shardlab::cli;

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << usage();
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    if (command == "worker") return run_worker(parse_options(args, true));
    if (command == "rs-probe") return run_rs_probe(args);  // one rank of `bench --section reduce_scatter`
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    if (command == "train") {
      RunOptions o = parse_options(args, true);
      RunReport r = run_strategy(o, self);
      print_report(r);
      if (!o.json.empty()) write_json(o.json, {r}, false);
      return 0;
    }
    if (command == "compare") {
      RunOptions o = parse_options(args, false);
      std::vector<RunReport> reports;
      for (const auto& s : strategies()) {
        if (o.train.clip_norm > 0 && !clips(s.name)) {
          std::cout << "compare: " << s.name << " left out: it cannot clip (--clip-norm)\n";
          continue;
        }
        RunOptions each = o;
        each.strategy = s.name;
        each.world_size = s.distributed ? o.world_size : 1;
        reports.push_back(run_strategy(each, self));
      }
      print_comparison(reports);
      if (!o.json.empty()) write_json(o.json, reports, true);
      return 0;
    }
    if (command == "bench") return run_bench(args, self);
    if (command == "export") {
      if (args.size() != 2 || args[0].rfind("--", 0) == 0 || args[1].rfind("--", 0) == 0)
        throw std::invalid_argument(
            "export expects a checkpoint directory and a file to write: shardlab export DIR "
            "model.safetensors");
      const shardlab::CheckpointIndex index = shardlab::read_checkpoint_index(args[0]);
      shardlab::export_checkpoint(args[0], args[1]);
      size_t model_tensors = 0;
      for (const auto& [name, saved] : index.tensors) model_tensors += name.rfind("optim.", 0) != 0;
      std::cout << "shardlab export: " << model_tensors << " tensors of '" << args[0] << "' (saved by "
                << index.world_size << " ranks; every piece checked against its CRC-32) written to '" << args[1]
                << "'\n";
      return 0;
    }
    std::cerr << "shardlab: unknown command '" << command << "'; expected train, compare, bench or export\n" << usage();
    return 2;
  } catch (const std::invalid_argument& e) {
    std::cerr << "shardlab: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shardlab: " << e.what() << "\n";
    return 1;
  }
}
