#include "shardlab/common/trace.h"

#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>

namespace shardlab {
namespace {

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// One complete ("X") event; times in steady-clock microseconds.
void event(std::ostream& out, bool& first, const std::string& name, const std::string& cat, int pid, int tid,
           int64_t start_ns, int64_t end_ns, const std::string& args) {
  out << (first ? "\n  " : ",\n  ") << "{\"name\": " << quoted(name) << ", \"cat\": " << quoted(cat)
      << ", \"ph\": \"X\", \"pid\": " << pid << ", \"tid\": " << tid << ", \"ts\": " << std::fixed
      << std::setprecision(3) << static_cast<double>(start_ns) / 1e3
      << ", \"dur\": " << static_cast<double>(end_ns - start_ns) / 1e3 << ", \"args\": {" << args << "}}";
  first = false;
}

void name_event(std::ostream& out, bool& first, const char* kind, int pid, int tid, const std::string& name) {
  out << (first ? "\n  " : ",\n  ") << "{\"name\": \"" << kind << "\", \"ph\": \"M\", \"pid\": " << pid
      << ", \"tid\": " << tid << ", \"args\": {\"name\": " << quoted(name) << "}}";
  first = false;
}

}  // namespace

Timeline::Scope::Scope(Timeline* timeline, std::string name, int step) : timeline_(timeline) {
  span_.name = std::move(name);
  span_.step = step;
  span_.start_ns = now_ns();
}

Timeline::Scope::~Scope() {
  span_.end_ns = now_ns();
  if (timeline_) timeline_->add(std::move(span_));
}

void write_chrome_trace(const std::string& path, int rank, const std::vector<TraceSpan>& compute,
                        const std::vector<CollectiveRecord>& collectives, const std::vector<WaitRecord>& waits,
                        const std::vector<CounterSample>& counters) {
  std::ostringstream out;
  bool first = true;
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  name_event(out, first, "process_name", rank, 0, "rank " + std::to_string(rank));
  name_event(out, first, "thread_name", rank, 1, "compute");
  for (const auto& s : compute)
    event(out, first, s.name, "compute", rank, 1, s.start_ns, s.end_ns,
          s.step >= 0 ? "\"step\": " + std::to_string(s.step) : "");
  for (const auto& w : waits) event(out, first, "wait: " + w.what, "wait", rank, 1, w.start_ns, w.end_ns, "");

  // Lanes: a collective goes to the first lane whose previous collective ended before it started.
  std::vector<int64_t> lane_end;
  for (size_t i = 0; i < collectives.size(); ++i) {
    const auto& c = collectives[i];
    if (c.end_ns == 0) continue;
    size_t lane = 0;
    while (lane < lane_end.size() && lane_end[lane] > c.start_ns) ++lane;
    if (lane == lane_end.size()) {
      lane_end.push_back(0);
      name_event(out, first, "thread_name", rank, static_cast<int>(2 + lane), "comm " + std::to_string(lane));
    }
    lane_end[lane] = c.end_ns;
    std::ostringstream args;
    args << "\"index\": " << i << ", \"op\": " << quoted(c.op) << ", \"wire_op\": " << quoted(c.wire_op)
         << ", \"dtype\": " << quoted(c10::toString(c.dtype))
         << ", \"wire_dtype\": " << quoted(c10::toString(c.wire_dtype)) << ", \"numel\": " << c.numel
         << ", \"bytes\": " << c.bytes << ", \"group\": " << quoted(c.group) << ", \"reduce\": " << quoted(c.reduce);
    event(out, first, c.op, "comm", rank, static_cast<int>(2 + lane), c.start_ns, c.end_ns, args.str());
  }
  for (const auto& c : counters) {
    out << (first ? "\n  " : ",\n  ") << "{\"name\": " << quoted(c.track) << ", \"ph\": \"C\", \"pid\": " << rank
        << ", \"ts\": " << std::fixed << std::setprecision(3) << static_cast<double>(c.ns) / 1e3 << ", \"args\": {";
    for (size_t i = 0; i < c.series.size(); ++i)
      out << (i ? ", " : "") << quoted(c.series[i].first) << ": " << std::setprecision(0) << c.series[i].second;
    out << "}}";
    first = false;
  }
  out << "\n]}\n";

  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << out.str();
    if (!f) throw std::runtime_error("cannot write trace file '" + path + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename trace to '" + path + "'");
}

}  // namespace shardlab
