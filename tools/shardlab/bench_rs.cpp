// `shardlab bench --section reduce_scatter`: the ring reduce-scatter built on c10d's send/recv (Note [Ring
// reduce-scatter] in common/core/src/comm/ring_collectives.cpp) against the all-reduce fallback that Gloo users get
// (PyTorch's FSDP on Gloo included), as real processes, at the sizes FSDP reduce-scatters; and whether kAuto's rule
// (ring_reduce_scatter_pays) picks the faster one at each size. Also the ring all-gather (Note [Ring all-gather])
// against the backend's own (Gloo 1.13: the list all-gather, with its private copy of the output).
#include "bench.h"

#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/comm/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>

#include <unistd.h>
#include <nlohmann/json.hpp>

namespace shardlab::cli {
namespace {

namespace fs = std::filesystem;

// Input sizes in bytes: a ladder from latency-bound to bandwidth-bound, with the FSDP section's unit in it (one
// block of the 4-block, width-128 tiny GPT: S x padded block numel x 4 bytes, about 775 KiB at any world size).
const std::vector<int64_t> kSizes{16 << 10, 64 << 10, 256 << 10, 775 << 10, 1 << 20, 4 << 20};
constexpr int kCalls = 20;  // timed calls per size, algorithm and round

}  // namespace

int run_rs_probe(const std::string& out, int rounds) {
  GroupOptions group;
  group.timeout = std::chrono::milliseconds(120'000);
  auto comm = communicator_from_env(group);
  const int world = comm->size();
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (size_t s = 0; s < kSizes.size(); ++s) {
    const int64_t numel = kSizes[s] / 4 / world * world;  // float32, divisible by the world size
    at::Tensor input = at::rand({numel});
    at::Tensor output = at::empty({numel / world});
    double best[2] = {1e30, 1e30};
    int64_t sent[2] = {0, 0};
    for (int round = 0; round < rounds; ++round) {
      for (int a = 0; a < 2; ++a) {  // interleaved: 0 the ring, 1 the all-reduce
        comm->set_reduce_scatter_algorithm(a == 0 ? ReduceScatterAlgorithm::kRing : ReduceScatterAlgorithm::kAllReduce);
        for (int w = 0; w < 3; ++w) comm->reduce_scatter(output, input).wait();  // warm up
        comm->barrier();
        const size_t first = comm->recorder().size();
        const auto start = std::chrono::steady_clock::now();
        for (int c = 0; c < kCalls; ++c) comm->reduce_scatter(output, input).wait();
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / kCalls;
        best[a] = std::min(best[a], ms);
        const CollectiveRecord r = comm->recorder().since(first).front();
        // What this rank sent: the ring records it; an all-reduce sends 2(N-1)/N of its input under a ring.
        sent[a] = r.wire_op == "reduce_scatter(ring)" ? r.bytes : 2 * (world - 1) * r.bytes / world;
      }
    }
    // The all-gather of the same output size: the ring against the backend's own, interleaved the same way.
    at::Tensor shard = at::rand({numel / world});
    at::Tensor gathered = at::empty({numel});
    double ag_best[2] = {1e30, 1e30};
    for (int round = 0; round < rounds; ++round) {
      for (int a = 0; a < 2; ++a) {
        comm->set_all_gather_algorithm(a == 0 ? AllGatherAlgorithm::kRing : AllGatherAlgorithm::kBackend);
        for (int w = 0; w < 3; ++w) comm->all_gather(gathered, shard).wait();
        comm->barrier();
        const auto start = std::chrono::steady_clock::now();
        for (int c = 0; c < kCalls; ++c) comm->all_gather(gathered, shard).wait();
        ag_best[a] = std::min(
            ag_best[a],
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / kCalls);
      }
    }
    // kBackend is in force here: the copy the backend's own all-gather makes (the ring makes none).
    const int64_t ag_copy = comm->all_gather_scratch_bytes(c10::kFloat, numel / world, c10::Device(c10::kCPU));
    rows.push_back({{"bytes", numel * 4},
                    {"ring_ms", best[0]},
                    {"all_reduce_ms", best[1]},
                    {"ring_sent", sent[0]},
                    {"all_reduce_sent", sent[1]},
                    {"ag_ring_ms", ag_best[0]},
                    {"ag_backend_ms", ag_best[1]},
                    {"ag_backend_copy", ag_copy}});
  }
  comm->barrier();
  if (comm->rank() == 0) std::ofstream(out) << nlohmann::ordered_json{{"world", world}, {"rows", rows}}.dump() << "\n";
  return 0;
}

RsBenchResult run_rs_bench(const RunOptions& run, int repeat, const std::string& self_exe) {
  RsBenchResult result;
  const fs::path dir = fs::temp_directory_path() / ("shardlab-rs-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  struct RemoveAtExit {
    fs::path dir;
    ~RemoveAtExit() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } remove_at_exit{dir};
  std::ostringstream md, ag_md, targets;
  nlohmann::ordered_json probes = nlohmann::ordered_json::array();
  ag_md << "| ranks | output KiB | ring ms | backend's ms | ring / backend's | copy beside the output: ring | "
           "backend's |\n|---|---|---|---|---|---|---|\n";
  double ag_worst = 0, ag_best_ratio = 1e30;
  md << "| ranks | input KiB | ring ms | all-reduce ms | ring / all-reduce | sent by ring | sent by all-reduce | "
        "auto picks | faster |\n|---|---|---|---|---|---|---|---|---|\n";
  int wrong = 0, rows = 0;
  double worst = 1.0;
  for (int world : {2, 3, 4}) {
    RunOptions o = run;
    o.world_size = world;
    const std::string file = (dir / ("rs" + std::to_string(world) + ".json")).string();
    const PeerRun r =
        run_peer_script(o, {self_exe, "rs-probe", "--out", file, "--repeat", std::to_string(repeat)}, file);
    if (!r.ok) throw std::runtime_error("reduce-scatter probe at " + std::to_string(world) + " ranks: " + r.problem);
    const nlohmann::json probe = peer_json(r, "the reduce-scatter probe at " + std::to_string(world) + " ranks");
    probes.push_back(nlohmann::ordered_json::parse(r.text));  // as the probe wrote it, key order kept
    for (const nlohmann::json& one : probe.value("rows", nlohmann::json::array())) {  // one per size, in kSizes order
      const double bytes = json_number(one, "bytes"), ring = json_number(one, "ring_ms"),
                   all_reduce = json_number(one, "all_reduce_ms");
      const bool auto_ring = ring_reduce_scatter_pays(world, static_cast<int64_t>(bytes));
      const bool ring_faster = ring < all_reduce;
      const double lost = auto_ring ? ring / all_reduce : all_reduce / ring;  // > 1: auto chose the slower
      ++rows;
      if (lost > 1.0) {
        ++wrong;
        worst = std::max(worst, lost);
      }
      md << "| " << world << " | " << std::fixed << std::setprecision(0) << bytes / 1024 << " | "
         << std::setprecision(3) << ring << " | " << all_reduce << " | " << std::setprecision(2) << ring / all_reduce
         << " | " << std::setprecision(0) << json_number(one, "ring_sent") << " | "
         << json_number(one, "all_reduce_sent") << " | " << (auto_ring ? "ring" : "all-reduce") << " | "
         << (ring_faster ? "ring" : "all-reduce") << " |\n";
      const double ag_ring = json_number(one, "ag_ring_ms"), ag_backend = json_number(one, "ag_backend_ms");
      ag_worst = std::max(ag_worst, ag_ring / ag_backend);
      ag_best_ratio = std::min(ag_best_ratio, ag_ring / ag_backend);
      ag_md << "| " << world << " | " << std::fixed << std::setprecision(0) << bytes / 1024 << " | "
            << std::setprecision(3) << ag_ring << " | " << ag_backend << " | " << std::setprecision(2)
            << ag_ring / ag_backend << " | 0 | " << std::setprecision(0) << json_number(one, "ag_backend_copy")
            << " |\n";
    }
  }
  targets
      << "- sent bytes per rank: the ring's from its record, (N-1)/N of the input; the all-reduce's 2(N-1)/N of the "
         "input it records (what a ring all-reduce sends)\n"
      << "- auto (ring_reduce_scatter_pays) picked the faster algorithm at " << rows - wrong << " of " << rows
      << " sizes";
  if (wrong > 0)
    targets << "; where it did not, the one it picked was at most " << std::fixed << std::setprecision(2) << worst
            << "x the faster";
  targets << "\n- the ring all-gather (kAuto: every CPU all-gather on Gloo) took " << std::fixed << std::setprecision(2)
          << ag_best_ratio << "-" << ag_worst << "x the backend's time, with no copy of the output beside it\n";
  result.heading = "Gloo on CPU, processes, float32; each figure the best over " + std::to_string(repeat) +
                   " rounds of the mean of " + std::to_string(kCalls) + " back-to-back calls";
  result.markdown =
      md.str() + "\nThe ring all-gather beside the backend's own, the same sizes as outputs:\n\n" + ag_md.str();
  result.targets = targets.str();
  result.json = probes.dump();
  return result;
}

}  // namespace shardlab::cli
