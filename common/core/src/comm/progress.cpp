#include "shardlab/core/comm/progress.h"

#include <sched.h>

// Note [Yielding to communication]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A bucketed DDP overlaps its all-reduces with backward only if the threads that move them (Gloo's worker and
// transport threads) get a core while backward computes. With as many busy compute threads as cores (2 ranks of
// one thread on 2 cores, the course's machine; or N ranks on N cores) they often do not get it in time: Linux's
// fair scheduler may let the running compute thread keep its core for the rest of its time slice (EEVDF, 6.6+:
// 0.75 ms x (1 + log2 cores)) before a woken thread runs, and a Gloo all-reduce needs several wake-ups in turn on
// both ranks. That is our reading; what was measured is this. Traced with
// `shardlab train --strategy overlap_optimizer --model tiny_gpt --trace DIR` (2 processes, 2 cores): an all-reduce
// launched by both ranks within 40 us took a median 2.6 ms while both ranks computed, against 0.15-0.3 ms with
// the cores idle; the buckets' all-reduces then finished one after another only once backward had ended, and all of
// them were exposed.
// The fix is a progress point: after each gradient-ready callback, while a collective is in flight, the compute
// thread calls sched_yield(), which hands its core to a runnable thread (a woken Gloo thread) at once and costs
// about a microsecond when there is none. GradientReadiness calls it, so stages 01, 02 (and 03's hooks and overlapped
// optimizer through it) and 04 get it without code of their own. In the same trace the first bucket's all-reduce then
// took a median 0.5 ms and the end-of-backward wait fell from a median 2.8 ms to 0.4 ms (`shardlab bench` prints the
// effect beside the rows; `--comm-yield off` turns it off). Nothing is yielded when no collective is in flight, and
// collectives of CUDA tensors are not counted (on a GPU, backward leaves its CPU thread mostly idle). A process-wide
// switch, set_yield_to_communication(false), turns it off, e.g. for a machine with cores to spare, where it would
// change nothing but cost a system call per gradient.
// Tried in the same traces and dropped: a short scheduler slice for Gloo's threads (sched_setattr) and SCHED_BATCH
// for the compute thread changed nothing clear; SCHED_IDLE for the compute thread shortened the all-reduces but
// starves compute whenever anything else runs; an all-reduce of our own over send/recv (a ring) was no faster than
// Gloo's at these sizes (0.74-1.47x idle, up to 3x slower under load).

namespace shardlab {
namespace {

std::atomic<bool> g_yield{true};
std::atomic<int64_t> g_in_flight{0};
std::atomic<uint64_t> g_yields{0};

}  // namespace

void set_yield_to_communication(bool on) { g_yield.store(on, std::memory_order_relaxed); }

bool yield_to_communication() { return g_yield.load(std::memory_order_relaxed); }

int64_t collectives_in_flight() { return g_in_flight.load(std::memory_order_relaxed); }

bool progress_point() {
  if (!g_yield.load(std::memory_order_relaxed) || g_in_flight.load(std::memory_order_relaxed) <= 0) return false;
  sched_yield();
  g_yields.fetch_add(1, std::memory_order_relaxed);
  return true;
}

uint64_t progress_yields() { return g_yields.load(std::memory_order_relaxed); }

namespace detail {

InFlight::InFlight() { g_in_flight.fetch_add(1, std::memory_order_relaxed); }

InFlight::~InFlight() { end(); }

void InFlight::end() {
  if (!ended_.exchange(true)) g_in_flight.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace detail
}  // namespace shardlab
