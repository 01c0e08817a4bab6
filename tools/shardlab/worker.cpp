#include "rank_result.h"
#include "run.h"
#include "strategies.h"

#include "shardlab/core/comm/process_group.h"
#include "shardlab/core/comm/progress.h"
#include "shardlab/core/comm/world.h"
#include "shardlab/core/device/device.h"
#include "shardlab/core/numbers.h"
#include "shardlab/core/storage/buffer_pool.h"
#include "shardlab/course/blas.h"
#include "shardlab/course/data.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <malloc.h>
#include <pthread.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <new>
#include <sstream>
#include <string>
#include <system_error>

namespace shardlab::cli {
namespace {

// Bytes this rank sends for collective `r` under the ring algorithms (the lower bounds: all-gather and
// reduce-scatter (N-1)/N of the whole tensor, all-reduce twice that), from the payload the record holds: an
// all-gather's input is one of N chunks; the ring reduce-scatter records what it sent; an all-reduce (also the
// reduce-scatter fallback) and a native reduce-scatter record their whole input. N is the size of the group the
// collective ran on.
double sent_bytes(const CollectiveRecord& r) {
  const double n = r.group_size, bytes = static_cast<double>(r.bytes);
  if (r.wire_op.rfind("all_gather", 0) == 0) return (n - 1) * bytes;
  if (r.wire_op == "reduce_scatter(ring)") return bytes;
  if (r.wire_op == "reduce_scatter") return (n - 1) / n * bytes;
  if (r.wire_op == "all_reduce") return 2 * (n - 1) / n * bytes;
  return 0;  // barrier, and a broadcast (setup only, never counted per step)
}

// Note [Peak RSS over the steady state]
// What a user's operating system sees is the process's resident memory, not the sum of the buffers a meter counts:
// the allocator's retained heap, libtorch's and Gloo's own, the activations. Four figures per worker:
//  - the base: VmRSS once the process groups exist, before the model is built (libtorch, Gloo, the data);
//  - the construction's peak: VmHWM once the model is built and wrapped (the process's peak so far);
//  - the steady peak, over the second half of the steps: Linux resets a process's VmHWM to its current RSS when "5"
//    is written to /proc/self/clear_refs, and VmHWM then is the most resident memory since. Where that file refuses
//    the write (some sandboxes), the most VmRSS seen at the end of each step stands in for it (a lower bound: a peak
//    inside a step can be missed);
//  - the run's peak: the larger of VmHWM just before that reset (construction, a checkpoint loaded, the first half
//    of the steps) and VmHWM at the end of the steps (the checkpoints saved between them included), so
//    construction is included. It ends with the last step: what
//    the worker then sends the driver (every parameter gathered, to compare with one device) is the tool's check, not
//    training. A whole model built before sharding shows here and in the construction's peak, not in the steady
//    peak.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

// A "Vm...:  N kB" line of /proc/self/status, in bytes (0 when absent).
double status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) != 0) continue;
    std::istringstream in(line.substr(key.size() + 1));
    double kib = 0;
    in >> kib;
    return kib * 1024;
  }
  return 0;
}

// Note [A rank's memory limit]
// `--memory-limit-mib N` sets each worker's RLIMIT_DATA (the soft limit; a lower hard limit stays) once the process
// groups, the data and OpenBLAS's buffers exist, just before the model is built, for a run that shows what fits in
// a rank's memory. RLIMIT_DATA rather than a cgroup's memory.max:
//  - A cgroup's limit is enforced by the kernel's OOM killer: the process dies by SIGKILL with no message of its own.
//    Under RLIMIT_DATA the allocation itself fails (brk and mmap return ENOMEM): libtorch throws "can't allocate
//    memory", and the worker reports it naming the limit, on the thread that asked.
//  - It is per process and unprivileged, so it works on any machine; a cgroup needs root or a delegated
//    hierarchy, which CI containers often lack.
//  - What it counts: since Linux 4.7, the private writable mappings (VmData): the heap, every anonymous mmap (every
//    tensor), the threads' stacks, the libraries' writable data. That is virtual memory, not resident: a page
//    mapped but never touched counts. So the limit is tighter than the resident figures of the report, and leaves
//    room for the process's base (`base_data_bytes`: VmData when the limit is set, just before the model is built,
//    with libtorch and Gloo's threads up).
//  - Threads' stacks would dominate it: glibc gives each new thread a stack of RLIMIT_STACK (8 MiB here), all of it
//    counted, and a worker runs dozens of threads (Gloo's, c10d's, libtorch's and OpenBLAS's pools) that use a few
//    KiB each. Under a limit the worker first sets the default stack of the threads it will start to
//    kThreadStack (2 MiB), so the limit measures the memory training holds. The main thread's stack is not
//    changed, and runs the forward and the backward.
constexpr size_t kThreadStack = size_t{2} << 20;

//  - OpenBLAS maps a work buffer of some hundred MiB per thread on its first product, and when that fails it retries
//    forever instead of failing. So the limit is set only once OpenBLAS has its buffers (one product first, with
//    the rank's threads), and the report's base_data_bytes, VmData just then, includes them: the limit's room for
//    training is the limit minus that base.
//  - glibc's defaults hold much memory that no tensor uses: each thread that allocates gets an arena of its own,
//    whose freed memory the others cannot reuse, and once a large block is freed the threshold above which blocks
//    are mapped apart rises to its size, so later large tensors come from the heap and leave it fragmented. For
//    the tiny GPT of 50M parameters on 4 ranks, FSDP needed 604 MiB of data memory with them and 467 MiB with one
//    arena and every block of 1 MiB or more mapped apart (freed at once): so under a limit the worker sets both
//    (mallopt), before any thread starts. It costs step time (every large tensor's pages are faulted in anew):
//    this is a setting for a run that shows what fits, not for speed.
void lean_allocations() {
  if (mallopt(M_ARENA_MAX, 1) != 1 || mallopt(M_MMAP_THRESHOLD, 1 << 20) != 1)
    throw std::runtime_error("--memory-limit-mib: could not set glibc's malloc options (mallopt)");
  pthread_attr_t attr;
  if (pthread_getattr_default_np(&attr) != 0)
    throw std::runtime_error("--memory-limit-mib: could not read the threads' default attributes");
  const bool set = pthread_attr_setstacksize(&attr, kThreadStack) == 0 && pthread_setattr_default_np(&attr) == 0;
  pthread_attr_destroy(&attr);
  if (!set) throw std::runtime_error("--memory-limit-mib: could not set the threads' default stack size");
}

void limit_data_memory(int mib) {
  at::mm(at::ones({256, 256}), at::ones({256, 256}));  // OpenBLAS's buffers, before the limit
  rlimit limit{};
  if (getrlimit(RLIMIT_DATA, &limit) != 0)
    throw std::runtime_error("--memory-limit-mib: getrlimit(RLIMIT_DATA) failed: " + std::string(std::strerror(errno)));
  const rlim_t bytes = static_cast<rlim_t>(mib) << 20;
  limit.rlim_cur = limit.rlim_max == RLIM_INFINITY ? bytes : std::min(bytes, limit.rlim_max);  // the hard one stays
  if (setrlimit(RLIMIT_DATA, &limit) != 0)
    throw std::runtime_error("--memory-limit-mib " + std::to_string(mib) +
                             ": setrlimit(RLIMIT_DATA) failed: " + std::strerror(errno));
}

// True for an allocation that failed: std::bad_alloc, libtorch's CPU allocator's error (whoever passed it on: a
// checkpoint's agreement quotes it, and another rank's failure reaches this one quoted with its rank), or a thread
// whose stack could not be mapped (std::system_error with EAGAIN).
bool out_of_memory(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
  if (const auto* system = dynamic_cast<const std::system_error*>(&e))
    if (system->code() == std::errc::resource_unavailable_try_again) return true;
  return std::string(e.what()).find("can't allocate memory") != std::string::npos;
}

// What a checkpoint of this run records beside the tensors: the steps done (where the data resumes: step k's
// global batch is a function of k and the seed) and the settings a resumed run is compared against.
std::map<std::string, std::string> checkpoint_metadata(const RunOptions& o, int steps_done) {
  std::ostringstream lr;
  lr.precision(17);
  lr << o.train.lr;
  return {{"step", std::to_string(steps_done)},
          {"model", o.train.model},
          {"seed", std::to_string(o.train.seed)},
          {"global_batch", std::to_string(o.train.global_batch)},
          {"optimizer", o.train.optimizer},
          {"lr", lr.str()},
          {"strategy", o.strategy},
          {"world_size", std::to_string(o.world_size)}};
}

}  // namespace

int resume_step(const std::map<std::string, std::string>& metadata, const std::string& path) {
  // Weights only (exported, or from PyTorch; no optimizer state): training starts at step 0, whatever step the
  // weights were taken at, with a fresh optimizer.
  if (!metadata.count("optim.kind")) return 0;
  const auto it = metadata.find("step");
  if (it == metadata.end()) return 0;
  if (const auto step = parse_integer(it->second, 0, std::numeric_limits<int>::max())) return static_cast<int>(*step);
  throw std::invalid_argument("--resume '" + path + "' has metadata step '" + it->second +
                              "'; expected the count of steps done (a checkpoint of shardlab train)");
}

namespace {

// The worker's run, under whatever limit run_worker set.
int run_worker_unlimited(const RunOptions& options) {
  RunOptions o = options;
  const Strategy& strategy = find_strategy(o.strategy);
  // One process per GPU, as under torchrun: "cuda" means the GPU of this rank's LOCAL_RANK.
  const int local_rank = strategy.can.communicates ? RankEnv::from_environment().local_rank : 0;
  const c10::Device device = device_for_rank(parse_device(o.train.device), local_rank);
  set_current_device(device);
  o.train.device = device.str();
  std::shared_ptr<World> group_world;  // every group of this rank, and the recorder they all write to
  int rank = 0, world = 1;
  set_yield_to_communication(o.comm_yield);
  if (o.cpu_allocator == "pool") BufferPool::install_for_cpu_tensors();
  if (strategy.can.communicates) {
    GroupOptions group;
    group.timeout = std::chrono::milliseconds(120'000);
    group.kind = o.backend == "nccl" ? BackendKind::kNccl : BackendKind::kGloo;
    group_world = World::from_environment(group);
    rank = group_world->rank();
    world = group_world->size();
  }
  if (o.threads > 0) {  // libtorch's threads and, when the BLAS is OpenBLAS, its threads (Note [BLAS threads per rank])
    at::set_num_threads(o.threads);
    set_blas_threads(o.threads);
  }
  auto data = make_dataset(o.train.model, o.train.seed);              // before the base, which counts it
  if (o.memory_limit_mib > 0) limit_data_memory(o.memory_limit_mib);  // Note [A rank's memory limit]
  const double base_rss = status_bytes("VmRSS");                      // Note [Peak RSS over the steady state]
  const double base_data = status_bytes("VmData");  // what RLIMIT_DATA counts: Note [A rank's memory limit]
  auto runner = make_runner(strategy, o.train, o.strategy_options, group_world.get());
  const double construction_rss = status_bytes("VmHWM");  // the peak so far: the model built (and wrapped)
  int first_step = 0;  // --resume: the checkpoint's step, where this run's data starts
  if (!o.resume_dir.empty()) {
    const int64_t t0 = now_ns();
    first_step = resume_step(runner->load(o.resume_dir), o.resume_dir);
    if (rank == 0)
      std::cout << "loaded checkpoint '" << o.resume_dir << "' (step " << first_step << ") in " << std::fixed
                << std::setprecision(1) << (now_ns() - t0) / 1e6 << std::defaultfloat << " ms" << std::endl;
  }
  CommRecorder* recorder = group_world ? &group_world->recorder() : nullptr;
  Timeline timeline;
  runner->set_timeline(o.trace_dir.empty() ? nullptr : &timeline);
  const size_t setup = recorder ? recorder->size() : 0;

  std::vector<double> losses, step_ms;
  std::vector<int64_t> step_starts_ns;  // and the end of the last step: per-step communication figures
  const uint64_t yields_before = progress_yields();
  const int64_t first_step_ns = now_ns();
  bool hwm_reset = false;  // Note [Peak RSS over the steady state]
  double rss_sampled = 0, run_peak_rss = 0;
  std::vector<std::pair<size_t, size_t>> saves;  // recorder ranges of the checkpoints' collectives: not training's
  const int half = first_step + (o.train.steps - first_step) / 2;
  for (int step = first_step; step < o.train.steps; ++step) {
    if (step == half) {
      run_peak_rss = status_bytes("VmHWM");
      hwm_reset = reset_peak_rss();
    }
    Batch local = rank_slice(data->global_batch(step, o.train.global_batch), rank, world).to(device);
    const auto t0 = std::chrono::steady_clock::now();
    step_starts_ns.push_back(now_ns());
    losses.push_back(runner->step(local));
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (step >= half) rss_sampled = std::max(rss_sampled, status_bytes("VmRSS"));
    // Every rank reports; the driver draws the mean (the global batch's loss). See run_strategy.
    std::cout << "@@progress " << step + 1 << " " << o.train.steps << " " << std::setprecision(17) << losses.back()
              << std::endl;
    const bool last = step + 1 == o.train.steps;
    if (!o.save_dir.empty() && (last || (o.save_every > 0 && (step + 1) % o.save_every == 0))) {
      const size_t from = recorder ? recorder->size() : 0;
      const int64_t t0 = now_ns();
      runner->save(o.save_dir, checkpoint_metadata(o, step + 1));
      if (recorder) saves.emplace_back(from, recorder->size());
      if (rank == 0)
        std::cout << "saved checkpoint '" << o.save_dir << "' at step " << step + 1 << " in " << std::fixed
                  << std::setprecision(1) << (now_ns() - t0) / 1e6 << std::defaultfloat << " ms" << std::endl;
    }
  }

  const int64_t last_step_ns = now_ns();
  const double steady_peak_rss = hwm_reset ? status_bytes("VmHWM") : rss_sampled;
  run_peak_rss = std::max(run_peak_rss, status_bytes("VmHWM"));
  step_starts_ns.push_back(last_step_ns);
  const uint64_t yields = progress_yields() - yields_before;

  // Results: the figures as JSON, the parameters as safetensors (Note [A rank's result files] in rank_result.cpp).
  RankResult result;
  result.first_step = first_step;
  result.losses = losses;
  result.step_ms = step_ms;
  // Broadcasts after construction (stage 02's one-time bucket rebuild) count as setup, not as per-step traffic.
  result.setup_collectives = static_cast<double>(setup);
  CommTime comm_ns;
  if (recorder) {
    std::vector<CollectiveRecord> records;  // training's: after construction, without a runner's measurements
    saves.push_back(runner->setup_records());
    const auto all = recorder->snapshot();
    for (size_t i = setup; i < all.size(); ++i) {
      const bool skipped =
          std::any_of(saves.begin(), saves.end(), [i](const auto& r) { return i >= r.first && i < r.second; });
      if (skipped) {
        result.setup_collectives += 1;  // a runner's measurement, or a checkpoint: once, not every step
        continue;
      }
      records.push_back(all[i]);
    }
    for (const auto& r : records) {
      if (r.op == "broadcast") {
        result.setup_collectives += 1;
        continue;
      }
      result.collectives += 1;
      result.bytes += static_cast<double>(r.bytes);
      result.sent_bytes += sent_bytes(r);
      GroupFigures& group = result.groups[group_role(r.group)];
      group.collectives += 1;
      group.bytes += static_cast<double>(r.bytes);
      group.name = r.group;
    }
    const auto waits = recorder->waits();
    comm_ns = comm_time(records, waits, first_step_ns, last_step_ns);
    // The typical step, beside the run's total: one slow step (a stalled core) moves a total, not a median.
    for (size_t s = 0; s + 1 < step_starts_ns.size(); ++s) {
      const CommTime t = comm_time(records, waits, step_starts_ns[s], step_starts_ns[s + 1]);
      if (t.busy_ns > 0)
        result.exposed_share.push_back(static_cast<double>(t.exposed_ns) / static_cast<double>(t.busy_ns));
    }
  }
  result.comm_busy_ms = comm_ns.busy_ns / 1e6;
  result.exposed_comm_ms = comm_ns.exposed_ns / 1e6;
  result.progress_yields = static_cast<double>(yields);
  result.buckets = static_cast<double>(runner->buckets());
  result.auto_caps = runner->auto_caps();
  result.peak_rss_bytes = steady_peak_rss;
  result.run_peak_rss_bytes = run_peak_rss;
  result.base_rss_bytes = base_rss;
  result.base_data_bytes = base_data;
  result.construction_rss_bytes = construction_rss;
  result.memory = runner->memory();
  if (!o.trace_dir.empty()) {
    write_chrome_trace(o.trace_dir + "/rank" + std::to_string(rank) + ".trace.json", rank, timeline.spans(),
                       recorder ? recorder->snapshot() : std::vector<CollectiveRecord>{},
                       recorder ? recorder->waits() : std::vector<WaitRecord>{}, runner->counters());
  }
  const std::string prefix = o.result_dir + "/rank" + std::to_string(rank);
  // A collective for the sharded strategies: before anything can throw. Every rank has the same --reference.
  if (o.reference != "none") write_rank_parameters(prefix, *runner);
  write_rank_result(prefix, result);
  return 0;
}

}  // namespace

int run_worker(const RunOptions& options) {
  if (options.memory_limit_mib > 0) lean_allocations();  // before any thread: Note [A rank's memory limit]
  try {
    return run_worker_unlimited(options);
  } catch (const std::exception& e) {
    if (options.memory_limit_mib <= 0 || !out_of_memory(e)) throw;
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);  // its what() carries a backtrace
    throw std::runtime_error("out of memory: each rank's data memory is limited to " +
                             std::to_string(options.memory_limit_mib) +
                             " MiB (--memory-limit-mib, RLIMIT_DATA) and an allocation failed: " +
                             (c10_error ? c10_error->what_without_backtrace() : e.what()));
  }
}

}  // namespace shardlab::cli
