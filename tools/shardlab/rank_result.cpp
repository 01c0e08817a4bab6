// A rank's result files (rank_result.h).
#include "rank_result.h"

#include "run.h"

#include "shardlab/core/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace shardlab::cli {

// Note [A rank's result files]
// A worker's figures go to the driver as JSON, each field named once in its struct and once in its macro below
// (nlohmann's NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE): the reader refuses a file without a field, naming the key, so a
// figure added on one side only is an error, not a silent 0. The parameters go as safetensors, float64 (what the
// driver compares with one device in), one tensor per parameter in registration order: the names are the
// registration index, zero-padded (the format lays tensors out by name, and a writer streams them in that order, one
// gathered unit at a time), and the metadata "names" lists the model's names in the same order. Both files are
// readable without shardlab: Python's json, and safetensors' (or numpy on its 8-byte header length, the header's
// JSON and the data).

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(GroupFigures, collectives, bytes, name)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(AutoCapsFigures, caps, buckets_theory)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MemoryFigures, peak_param_bytes, peak_param_bytes_theory, peak_grad_bytes,
                                   peak_grad_bytes_theory)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(RankResult, first_step, losses, step_ms, setup_collectives, collectives, bytes,
                                   sent_bytes, comm_busy_ms, exposed_comm_ms, exposed_share, groups, progress_yields,
                                   buckets, auto_caps, peak_rss_bytes, run_peak_rss_bytes, base_rss_bytes,
                                   base_data_bytes, construction_rss_bytes, memory)

void write_rank_result(const std::string& prefix, const RankResult& result) {
  write_file_atomically(prefix + ".json", nlohmann::json(result).dump(1) + "\n");
}

RankResult read_rank_result(const std::string& prefix) {
  const std::string path = prefix + ".json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("missing worker result " + path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str()).get<RankResult>();
  } catch (const nlohmann::json::exception& e) {  // a missing key or one of another type: named by nlohmann
    throw std::runtime_error("worker result " + path + " is not a rank's result: " + e.what());
  }
}

namespace {
std::string tensor_name(size_t index) {
  std::string name = std::to_string(index);
  return std::string(name.size() < 6 ? 6 - name.size() : 0, '0') + name;
}
}  // namespace

void write_rank_parameters(const std::string& prefix, StepRunner& runner) {
  std::vector<safetensors::TensorSpec> specs;
  nlohmann::json names = nlohmann::json::array();
  for (const auto& [name, sizes] : runner.full_parameter_shapes()) {
    specs.push_back({tensor_name(specs.size()), at::kDouble, sizes});
    names.push_back(name);
  }
  // Written beside and renamed once whole (the Writer's contract). Every rank visits every parameter even when a
  // write fails (the sharded strategies gather each unit with the other ranks), and says why afterwards.
  const std::string path = prefix + ".safetensors", staging = path + ".partial";
  std::exception_ptr failed;
  std::unique_ptr<safetensors::Writer> writer;
  try {
    writer = std::make_unique<safetensors::Writer>(staging, specs,
                                                   std::map<std::string, std::string>{{"names", names.dump()}});
  } catch (...) {
    failed = std::current_exception();
  }
  runner.visit_full_parameters([&writer, &failed](const at::Tensor& p) {
    if (failed) return;
    try {
      writer->write(p.detach().to(at::kDouble));
    } catch (...) {
      failed = std::current_exception();
    }
  });
  if (failed) std::rethrow_exception(failed);
  writer->finish();
  std::error_code ec;
  std::filesystem::rename(staging, path, ec);
  if (ec) throw std::runtime_error("cannot rename " + staging + " to " + path + ": " + ec.message());
}

at::Tensor read_rank_parameters(const std::string& prefix) {
  const std::string path = prefix + ".safetensors";
  safetensors::Reader reader(path);  // names the file when it is missing or not safetensors
  const size_t count = reader.header().tensors.size();
  std::vector<at::Tensor> flat;
  for (size_t i = 0; i < count; ++i) {
    const std::string name = tensor_name(i);
    if (reader.header().tensors.count(name) == 0 || reader.info(name).dtype != at::kDouble)
      throw std::runtime_error("worker result " + path + ": expected float64 tensors named 000000 to " +
                               tensor_name(count - 1) + "; tensor " + name + " is missing or of another dtype");
    flat.push_back(reader.tensor(name).view({-1}));
  }
  return flat.empty() ? at::empty({0}, at::kDouble) : at::cat(flat);
}

}  // namespace shardlab::cli
