// The index format: what a sharded checkpoint's `index.json` says (every tensor's dtype, full shape and pieces, each
// with its file, rows and CRC-32; every file's size; the metadata), written from the ranks' descriptions of what
// each saved after checking that the pieces tile every tensor exactly once, and read back, checked the same way,
// into a CheckpointIndex. A full checkpoint (one safetensors file) is read into the same CheckpointIndex from its
// header, one piece per tensor. The format is in docs/checkpoints.md.

#include "shardlab/core/checkpoint/checkpoint.h"

#include "detail/checkpoint_internal.h"

#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/numbers.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace shardlab {

namespace fs = std::filesystem;

using detail::kCrcKey;
using detail::kFormatKey;
using detail::kFormatPt;
using detail::kIndexName;
using detail::kOldSuffix;
using detail::rows_in;
using detail::without_trailing_slash;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kFormatName = "shardlab.checkpoint";

}  // namespace

// What one rank wrote (step 2), as JSON: every tensor's dtype and sizes, and the piece it saved.
nlohmann::json detail::describe(const ShardedState& state, const std::string& file, uint64_t bytes,
                                const std::vector<uint32_t>& crcs) {
  nlohmann::json j = {{"file", file}, {"bytes", bytes}, {"tensors", nlohmann::json::array()}};
  size_t written = 0;
  for (const StateTensor& t : state.tensors) {
    nlohmann::json e = {
        {"name", t.name}, {"dtype", safetensors::dtype_name(t.local.scalar_type())}, {"shape", t.full_sizes}};
    if (t.saves && local_rows(t) > 0) {
      e["rows"] = {t.first_row, local_rows(t)};
      e["crc32"] = crcs.at(written++);
    }
    j["tensors"].push_back(std::move(e));
  }
  return j;
}

// Rank 0, step 3: the index from every rank's description; throws std::invalid_argument when the ranks disagree
// or the pieces do not tile a tensor.
nlohmann::json detail::build_index(const std::vector<nlohmann::json>& ranks,
                                   const std::map<std::string, std::string>& meta) {
  nlohmann::json tensors = nlohmann::json::object();
  nlohmann::json files = nlohmann::json::object();
  const nlohmann::json& zero = ranks[0]["tensors"];
  for (size_t r = 0; r < ranks.size(); ++r) {
    const nlohmann::json& mine = ranks[r]["tensors"];
    if (mine.size() != zero.size())
      throw std::invalid_argument("rank " + std::to_string(r) + " has " + std::to_string(mine.size()) +
                                  " state tensors, rank 0 has " + std::to_string(zero.size()));
    for (size_t i = 0; i < mine.size(); ++i) {
      const nlohmann::json& e = mine[i];
      const std::string name = e["name"];
      if (e["name"] != zero[i]["name"] || e["dtype"] != zero[i]["dtype"] || e["shape"] != zero[i]["shape"])
        throw std::invalid_argument("state tensor " + std::to_string(i) + " differs: rank " + std::to_string(r) +
                                    " has '" + name + "' " + e["dtype"].get<std::string>() + " " + e["shape"].dump() +
                                    ", rank 0 has '" + zero[i]["name"].get<std::string>() + "' " +
                                    zero[i]["dtype"].get<std::string>() + " " + zero[i]["shape"].dump());
      if (!tensors.contains(name))
        tensors[name] = {{"dtype", e["dtype"]}, {"shape", e["shape"]}, {"pieces", nlohmann::json::array()}};
      if (e.contains("rows"))
        tensors[name]["pieces"].push_back(
            {{"file", ranks[r]["file"]}, {"rows", e["rows"]}, {"crc32", e["crc32"]}, {"rank", r}});
    }
    if (!ranks[r]["file"].get<std::string>().empty()) files[ranks[r]["file"].get<std::string>()] = ranks[r]["bytes"];
  }
  for (auto& [name, t] : tensors.items()) {
    auto& pieces = t["pieces"];
    std::sort(pieces.begin(), pieces.end(),
              [](const nlohmann::json& a, const nlohmann::json& b) { return a["rows"][0] < b["rows"][0]; });
    const std::vector<int64_t> shape = t["shape"];
    int64_t at = 0;
    for (auto& p : pieces) {
      const int64_t first = p["rows"][0];
      const int64_t rows = p["rows"][1];
      if (first != at)
        throw std::invalid_argument(
            "tensor '" + name + "': rows [" + std::to_string(std::min(first, at)) + ", " +
            std::to_string(std::max(first, at)) + ") are " +
            (first > at ? "saved by no rank" : "saved twice (rank " + p["rank"].dump() + " and another)") +
            "; exactly one rank must save each row");
      at = first + rows;
      p.erase("rank");
    }
    if (at != rows_in(shape))
      throw std::invalid_argument("tensor '" + name + "': rows [" + std::to_string(at) + ", " +
                                  std::to_string(rows_in(shape)) + ") are saved by no rank");
  }
  return {{"format", kFormatName}, {"version", kFormatVersion}, {"world_size", ranks.size()}, {"metadata", meta},
          {"files", files},        {"tensors", tensors}};
}

namespace {

// `text` as a count in [0, max], or a std::runtime_error naming `where` (a file and a key).
uint64_t parse_count(const std::string& text, int64_t max, const std::string& where) {
  const std::optional<int64_t> v = parse_integer(text, 0, max);
  if (!v) throw std::runtime_error(where + " is '" + text + "', not a count up to " + std::to_string(max));
  return static_cast<uint64_t>(*v);
}

// A loaded index's pieces of tensor `name` must tile its rows exactly once (an index edited or damaged by hand
// would otherwise leave rows unread); sorts them by first row. @throws std::runtime_error naming `file`.
void check_tiling(const std::string& file, const std::string& name, SavedTensor& saved) {
  std::sort(saved.pieces.begin(), saved.pieces.end(),
            [](const SavedPiece& a, const SavedPiece& b) { return a.first_row < b.first_row; });
  int64_t at = 0;
  for (const SavedPiece& p : saved.pieces) {
    if (p.first_row != at || p.rows <= 0)
      throw std::runtime_error("checkpoint index '" + file + "': the pieces of '" + name + "' do not tile its " +
                               std::to_string(rows_in(saved.sizes)) + " rows (a piece at row " +
                               std::to_string(p.first_row) + " of " + std::to_string(p.rows) + " rows, expected row " +
                               std::to_string(at) + ")");
    at += p.rows;
  }
  if (at != rows_in(saved.sizes))
    throw std::runtime_error("checkpoint index '" + file + "': the pieces of '" + name + "' cover " +
                             std::to_string(at) + " of its " + std::to_string(rows_in(saved.sizes)) + " rows");
}

// The sharded checkpoint in `dir`, from its index `file`; std::runtime_error naming `file` when it is unreadable,
// malformed or of another format.
CheckpointIndex index_from_json(const std::string& dir, const std::string& file) {
  nlohmann::json j;
  try {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::runtime_error("cannot open '" + file + "'");
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("checkpoint index '" + file + "' is not JSON (" + e.what() + ")");
  }
  CheckpointIndex index;
  index.path = dir;
  try {
    if (j.at("format") != kFormatName || j.at("version") != kFormatVersion)
      throw std::runtime_error("checkpoint index '" + file + "' is format " + j.at("format").dump() + " version " +
                               j.at("version").dump() + "; this shardlab reads " + kFormatName + " version " +
                               std::to_string(kFormatVersion));
    index.world_size = j.at("world_size");
    index.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    for (const auto& [name, bytes] : j.at("files").items()) index.files[dir + "/" + name] = bytes.get<uint64_t>();
    for (const auto& [name, t] : j.at("tensors").items()) {
      SavedTensor saved;
      saved.dtype = safetensors::dtype_of(t.at("dtype"));
      saved.sizes = t.at("shape").get<std::vector<int64_t>>();
      for (const auto& p : t.at("pieces")) {
        SavedPiece piece;
        piece.file = dir + "/" + p.at("file").get<std::string>();
        piece.first_row = p.at("rows").at(0);
        piece.rows = p.at("rows").at(1);
        piece.has_crc = true;
        const uint64_t crc = p.at("crc32").get<uint64_t>();
        if (crc > 0xffffffffULL)
          throw std::runtime_error("checkpoint index '" + file + "': a CRC-32 of '" + name + "' is " +
                                   std::to_string(crc));
        piece.crc32 = static_cast<uint32_t>(crc);
        saved.pieces.push_back(piece);
      }
      check_tiling(file, name, saved);
      index.tensors.emplace(name, std::move(saved));
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("checkpoint index '" + file + "' is malformed (" + e.what() + ")");
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error("checkpoint index '" + file + "': " + e.what());
  }
  return index;
}

// A full checkpoint (any safetensors `file`), from its header: one piece per tensor, with the CRC-32 the file's
// metadata records where shardlab wrote it.
CheckpointIndex index_from_file(const std::string& file) {
  const safetensors::Reader reader(file);
  CheckpointIndex index;
  index.path = file;
  index.files[file] = reader.header().file_bytes;
  for (const auto& [key, value] : reader.header().metadata)
    if (key.rfind(kCrcKey, 0) != 0 && !(key == kFormatKey && value == kFormatPt)) index.metadata[key] = value;
  for (const auto& [name, info] : reader.header().tensors) {
    SavedTensor saved;
    saved.dtype = info.dtype;
    saved.sizes = info.shape;
    SavedPiece piece{file, 0, rows_in(info.shape), false, 0};
    const auto crc = reader.header().metadata.find(kCrcKey + name);
    if (crc != reader.header().metadata.end()) {
      piece.has_crc = true;
      piece.crc_in_file = true;
      piece.crc32 =
          static_cast<uint32_t>(parse_count(crc->second, 0xffffffffLL, "file '" + file + "' metadata " + crc->first));
    }
    saved.pieces.push_back(piece);
    index.tensors.emplace(name, std::move(saved));
  }
  return index;
}

}  // namespace

CheckpointIndex read_checkpoint_index(const std::string& path_in) {
  const std::string path = without_trailing_slash(path_in);
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const std::string file = path + "/" + kIndexName;
    if (!fs::exists(file, ec))
      throw std::runtime_error("'" + path + "' has no " + kIndexName +
                               ": not a shardlab checkpoint, or a save that never completed");
    return index_from_json(path, file);
  }
  if (fs::is_regular_file(path, ec)) return index_from_file(path);
  const std::string old = path + kOldSuffix;  // a save interrupted between its two renames
  if (fs::exists(old + "/" + kIndexName, ec)) return index_from_json(old, old + "/" + kIndexName);
  throw std::runtime_error("no checkpoint at '" + path + "' (neither a directory with " + kIndexName +
                           " nor a safetensors file)");
}

}  // namespace shardlab
