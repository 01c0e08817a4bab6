#include "shardlab/core/trace.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace shardlab {
namespace {

using Json = nlohmann::ordered_json;

// Microseconds, as Chrome's trace format counts, to the nanosecond.
double us(int64_t ns) { return static_cast<double>(ns) / 1e3; }

// One complete ("X") event.
Json event(const std::string& name, const std::string& cat, int pid, int tid, int64_t start_ns, int64_t end_ns,
           Json args) {
  return {{"name", name},
          {"cat", cat},
          {"ph", "X"},
          {"pid", pid},
          {"tid", tid},
          {"ts", us(start_ns)},
          {"dur", us(end_ns - start_ns)},
          {"args", args.is_null() ? Json::object() : std::move(args)}};
}

// A metadata ("M") event naming a process or a thread.
Json name_event(const char* kind, int pid, int tid, const std::string& name) {
  return {{"name", kind}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
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
  Json events = Json::array();
  events.push_back(name_event("process_name", rank, 0, "rank " + std::to_string(rank)));
  events.push_back(name_event("thread_name", rank, 1, "compute"));
  for (const auto& s : compute)
    events.push_back(
        event(s.name, "compute", rank, 1, s.start_ns, s.end_ns, s.step >= 0 ? Json{{"step", s.step}} : Json::object()));
  for (const auto& w : waits) events.push_back(event("wait: " + w.what, "wait", rank, 1, w.start_ns, w.end_ns, {}));

  // Lanes: a collective goes to the first lane whose previous collective ended before it started.
  std::vector<int64_t> lane_end;
  for (size_t i = 0; i < collectives.size(); ++i) {
    const auto& c = collectives[i];
    if (c.end_ns == 0) continue;
    size_t lane = 0;
    while (lane < lane_end.size() && lane_end[lane] > c.start_ns) ++lane;
    if (lane == lane_end.size()) {
      lane_end.push_back(0);
      events.push_back(name_event("thread_name", rank, static_cast<int>(2 + lane), "comm " + std::to_string(lane)));
    }
    lane_end[lane] = c.end_ns;
    events.push_back(event(c.op, "comm", rank, static_cast<int>(2 + lane), c.start_ns, c.end_ns,
                           {{"index", i},
                            {"op", c.op},
                            {"wire_op", c.wire_op},
                            {"dtype", c10::toString(c.dtype)},
                            {"wire_dtype", c10::toString(c.wire_dtype)},
                            {"numel", c.numel},
                            {"bytes", c.bytes},
                            {"group", c.group},
                            {"reduce", c.reduce}}));
  }
  for (const auto& c : counters) {
    Json series = Json::object();
    for (const auto& [name, value] : c.series) series[name] = std::llround(value);  // bytes, counts
    events.push_back({{"name", c.track}, {"ph", "C"}, {"pid", rank}, {"ts", us(c.ns)}, {"args", series}});
  }
  const Json trace{{"displayTimeUnit", "ms"}, {"traceEvents", std::move(events)}};

  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << trace.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
    if (!f) throw std::runtime_error("cannot write trace file '" + path + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename trace to '" + path + "'");
}

}  // namespace shardlab
