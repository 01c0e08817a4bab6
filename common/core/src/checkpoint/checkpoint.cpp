#include "shardlab/core/checkpoint/checkpoint.h"

#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/comm/text_gather.h"
#include "shardlab/core/errors.h"
#include "shardlab/core/numbers.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>

namespace shardlab {

// Note [Saving so that nothing is lost]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A save may be killed at any moment (a rank dies, the job is preempted), and the previous checkpoint must then
// still be there, whole. So nothing is written where the checkpoint is until everything is complete:
//  1. rank 0 makes a staging directory beside it, `<dir>.shardlab-partial` (a leftover of a killed save is removed
//  first);
//     the ranks agree that it exists (an all-gather of text: any rank's error stops every rank);
//  2. every rank that saves rows writes its safetensors file there and flushes it to the disk (fsync), then the
//     ranks all-gather what each wrote (which rows of which tensor, the CRC-32 of each piece) or its error;
//  3. rank 0 checks that the pieces tile every tensor exactly once, writes `index.json` last and flushes it and
//     the directory, then puts the staging directory in place of `<dir>` in one step: rename(2) when there is
//     none, else renameat2(RENAME_EXCHANGE), which swaps the two directories atomically (where a filesystem
//     cannot, `<dir>` is first renamed to `<dir>.shardlab-old`, which read_checkpoint_index falls back to); the old
//     checkpoint, now in the staging directory, is removed. A last all-gather tells every rank the outcome.
// A kill before the swap leaves `<dir>` untouched; after it, `<dir>` is the new checkpoint, whole: its index was
// written after every file it names was on the disk. A directory that is not a shardlab checkpoint (no
// index.json, not empty) is never replaced: what the user keeps there is not ours to remove.
//
// Only rank 0's metadata is saved (every rank is expected to pass the same).

// Note [Loading all or nothing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint that does not fit (another model, shape or dtype), is incomplete (a rank's file missing), truncated
// or corrupt must be refused before any parameter or optimizer state changes, on every rank alike (a rank that
// went on alone would wait for the others in its next collective). So each rank, before touching `state`:
//  - reads the index and matches it with its state (names, dtypes, full sizes);
//  - checks that every file of the checkpoint exists with the size the index recorded (a stat per file: a
//    truncated file anywhere is caught by every rank);
//  - checks the CRC-32 of its share of the pieces: piece k (in the index's order) is read whole by rank
//    k mod world size, so the checkpoint is read about once across the ranks for the check;
//  - reads the rows of the saved pieces that overlap its own rows into new tensors (only those bytes);
// and the ranks all-gather their outcome. Only when no rank met an error does each copy its new tensors into
// `state`; otherwise every rank throws the first error (the lowest rank's), naming the file.

namespace fs = std::filesystem;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kFormatName = "shardlab.checkpoint";
constexpr const char* kIndexName = "index.json";
constexpr const char* kCrcKey = "shardlab.crc32.";  // full checkpoints: "__metadata__" key of a tensor's CRC-32
// Full files: the "__metadata__" key Hugging Face's transformers requires, and the value it requires for PyTorch's
// tensors (it refuses a safetensors file whose metadata lacks it). Written into every full file; a user's metadata
// may not give it another value, and a load does not hand it back as the user's.
constexpr const char* kFormatKey = "format";
constexpr const char* kFormatPt = "pt";
// The save's own siblings of a checkpoint (names no user picks by chance: they are removed without asking).
constexpr const char* kStagingSuffix = ".shardlab-partial";
constexpr const char* kOldSuffix = ".shardlab-old";

// An error every rank throws alike: 'I' std::invalid_argument, 'R' std::runtime_error.
struct Outcome {
  char kind = 0;
  std::string message;
  std::string text() const { return kind ? std::string(1, kind) + message : std::string(); }
};

// All-gathers every rank's outcome; throws the lowest rank's error on every rank.
void agree(Communicator& comm, const Outcome& mine, const std::string& what) {
  const std::vector<std::string> all = all_gather_text(comm, mine.text());
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const std::string message =
        what + ": " + (comm.size() > 1 ? "rank " + std::to_string(r) + ": " : "") + all[r].substr(1);
    if (all[r][0] == 'I') throw std::invalid_argument(message);
    throw std::runtime_error(message);
  }
}

template <typename F>
Outcome attempt(F&& f) {
  try {
    f();
    return {};
  } catch (const std::invalid_argument& e) {
    return {'I', e.what()};
  } catch (const std::exception& e) {
    return {'R', e.what()};
  }
}

int64_t rows_in(const std::vector<int64_t>& sizes) { return sizes.empty() ? 1 : sizes.front(); }

int64_t row_numel(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (size_t d = 1; d < sizes.size(); ++d) n *= sizes[d];
  return n;
}

// The rows `t` holds of its full tensor (1 for a 0-dim tensor).
int64_t local_rows(const StateTensor& t) { return t.full_sizes.empty() ? 1 : t.local.size(0); }

// Whether two contiguous CPU tensors of one dtype and size hold the same bytes (NaNs by their bits).
bool equal_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return true;  // no rows here (data_ptr may be null)
  return std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0;
}

// The sizes of rows [.., .. + rows) of a tensor of `full` sizes.
std::vector<int64_t> piece_sizes(const std::vector<int64_t>& full, int64_t rows) {
  std::vector<int64_t> s = full;
  if (!s.empty()) s.front() = rows;
  return s;
}

std::string sizes_text(const std::vector<int64_t>& s) { return c10::str(c10::IntArrayRef(s)); }

// Checks one rank's state on its own: names unique, every local a piece of its full sizes.
// The metadata key kFormatKey is the file format's (Hugging Face's "pt"): a user's metadata may not give it another
// value, checked when a save starts (a sharded checkpoint exports to a full file).
void check_format_key(const std::map<std::string, std::string>& metadata) {
  const auto format = metadata.find(kFormatKey);
  if (format != metadata.end() && format->second != kFormatPt)
    throw std::invalid_argument("metadata key '" + std::string(kFormatKey) + "' is '" + format->second +
                                "'; it is reserved for \"" + kFormatPt +
                                "\" in a full safetensors file, which Hugging Face's transformers requires: keep your "
                                "value under another key");
}

void check_state(const ShardedState& state) {
  check_format_key(state.metadata);
  std::set<std::string> names;
  for (const StateTensor& t : state.tensors) {
    if (t.name.empty() || !names.insert(t.name).second)
      throw std::invalid_argument("the state has an empty or repeated tensor name '" + t.name + "'");
    if (!t.local.defined()) throw std::invalid_argument("state tensor '" + t.name + "' is undefined");
    safetensors::dtype_name(t.local.scalar_type());  // throws for a dtype the format cannot hold
    const std::vector<int64_t> want = piece_sizes(t.full_sizes, local_rows(t));
    if (t.local.sizes().vec() != want || t.first_row < 0 || t.first_row + local_rows(t) > rows_in(t.full_sizes))
      throw std::invalid_argument("state tensor '" + t.name + "' holds sizes " + sizes_text(t.local.sizes().vec()) +
                                  " from row " + std::to_string(t.first_row) + ", which is not a piece of its full " +
                                  "sizes " + sizes_text(t.full_sizes));
  }
  for (const auto& [alias, name] : state.aliases)
    if (names.count(alias) || !names.count(name))
      throw std::invalid_argument("the state's alias '" + alias + "' -> '" + name +
                                  "' must name a tensor of the state by another name");
}

std::string rank_file(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open '" + path + "' to flush it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw std::runtime_error("cannot flush '" + path + "': " + std::strerror(errno));
}

void write_text_file(const std::string& path, const std::string& text) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw std::runtime_error("cannot write '" + path + "'");
  }
  fsync_path(path, false);
}

std::string parent_of(const std::string& path) {
  const fs::path p = fs::absolute(fs::path(path)).parent_path();
  return p.empty() ? "." : p.string();
}

std::string without_trailing_slash(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// Puts `staging` where `dir` is, in one step where the filesystem can (Note [Saving so that nothing is lost]).
void swap_into_place(const std::string& staging, const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    if (::rename(staging.c_str(), dir.c_str()) != 0)
      throw std::runtime_error("cannot rename '" + staging + "' to '" + dir + "': " + std::strerror(errno));
  } else if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(staging, ec);  // the previous checkpoint
  } else {
    const std::string old = dir + kOldSuffix;
    fs::remove_all(old, ec);
    if (::rename(dir.c_str(), old.c_str()) != 0 || ::rename(staging.c_str(), dir.c_str()) != 0)
      throw std::runtime_error("cannot put '" + staging + "' in place of '" + dir + "': " + std::strerror(errno));
  }
  fs::remove_all(dir + kOldSuffix, ec);  // the fallback's, or a stale one from a save killed in it: never loaded again
  try {  // the swap is done: a failure to flush the parent must not report the save as failed
    fsync_path(parent_of(dir), true);
  } catch (const std::exception& e) {
    warn_once("checkpoint.fsync_parent", std::string("save_checkpoint: ") + e.what() +
                                             "; the checkpoint is in place, but a power loss now may undo the rename");
  }
}

// Rank 0, step 1: a fresh staging directory; `dir` must be a checkpoint or absent.
void prepare_staging(const std::string& dir, const std::string& staging) {
  std::error_code ec;
  if (const std::string file = file_in_the_way(dir); !file.empty())
    throw std::invalid_argument("cannot save a checkpoint into '" + dir + "': '" + file +
                                "' is a file, not a directory");
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec))
      throw std::invalid_argument("'" + dir + "' exists and is not a directory; not replacing it");
    if (!fs::exists(fs::path(dir) / kIndexName, ec) && !fs::is_empty(dir, ec))
      throw std::invalid_argument("'" + dir + "' is a directory with no " + kIndexName +
                                  ": not a shardlab checkpoint, so not replacing it (choose another directory)");
  }
  fs::remove_all(staging, ec);
  fs::create_directories(staging);
}

// What one rank wrote (step 2), as JSON: every tensor's dtype and sizes, and the piece it saved.
nlohmann::json describe(const ShardedState& state, const std::string& file, uint64_t bytes,
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

std::vector<std::pair<std::string, at::Tensor>> saved_pieces(const ShardedState& state) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const StateTensor& t : state.tensors)
    if (t.saves && local_rows(t) > 0) out.emplace_back(t.name, t.local);
  return out;
}

// Rank 0, step 3: the index from every rank's description; throws std::invalid_argument when the ranks disagree
// or the pieces do not tile a tensor.
nlohmann::json build_index(const std::vector<nlohmann::json>& ranks, const std::map<std::string, std::string>& meta) {
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

// Open readers, one per file, checked against the index's view of each piece.
class Pieces {
 public:
  Pieces() = default;

  const safetensors::Reader& reader(const std::string& file) {
    auto it = readers_.find(file);
    if (it == readers_.end()) it = readers_.emplace(file, std::make_unique<safetensors::Reader>(file)).first;
    return *it->second;
  }

  // The piece's entry in its file, checked against the index.
  const safetensors::TensorInfo& info(const std::string& name, const SavedTensor& saved, const SavedPiece& piece) {
    const safetensors::TensorInfo& i = reader(piece.file).info(name);
    if (i.dtype != saved.dtype || i.shape != piece_sizes(saved.sizes, piece.rows))
      throw std::runtime_error("file '" + piece.file + "' holds '" + name + "' as " + safetensors::dtype_name(i.dtype) +
                               " " + sizes_text(i.shape) + "; the index says " + safetensors::dtype_name(saved.dtype) +
                               " " + sizes_text(piece_sizes(saved.sizes, piece.rows)) +
                               " (a mixed or corrupt checkpoint)");
    return i;
  }

  void check_crc(const std::string& name, const SavedTensor& saved, const SavedPiece& piece) {
    info(name, saved, piece);
    const uint32_t crc = reader(piece.file).crc32(name);
    if (crc != piece.crc32)
      // A full file records its CRC-32s in its own metadata; a sharded checkpoint, in its index.json.
      throw std::runtime_error("file '" + piece.file + "' is corrupt: the CRC-32 of '" + name + "' (rows [" +
                               std::to_string(piece.first_row) + ", " + std::to_string(piece.first_row + piece.rows) +
                               "), half-open) is " + std::to_string(crc) + ", " +
                               (piece.crc_in_file ? "the file's metadata" : "the index") + " recorded " +
                               std::to_string(piece.crc32));
  }

  // Rows [first, first + dst.size(0)) of saved tensor `name` into `dst` (contiguous CPU, the saved dtype).
  void read_rows(const std::string& name, const SavedTensor& saved, int64_t first, const at::Tensor& dst) {
    const int64_t rows = saved.sizes.empty() ? 1 : dst.size(0);
    const uint64_t row_bytes = static_cast<uint64_t>(row_numel(saved.sizes)) * c10::elementSize(saved.dtype);
    auto* out = static_cast<char*>(dst.data_ptr());
    for (const SavedPiece& piece : saved.pieces) {
      const int64_t lo = std::max(first, piece.first_row);
      const int64_t hi = std::min(first + rows, piece.first_row + piece.rows);
      if (lo >= hi) continue;
      info(name, saved, piece);
      reader(piece.file)
          .read(name, static_cast<uint64_t>(lo - piece.first_row) * row_bytes,
                out + static_cast<uint64_t>(lo - first) * row_bytes, static_cast<uint64_t>(hi - lo) * row_bytes);
    }
  }

 private:
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers_;
};

// Note [A tied weight in a file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor registered under several names (ShardedState::aliases) is saved once, under its first name, as
// named_state lists it. Other writers choose otherwise: Hugging Face's safetensors.torch.save_model keeps the
// name that sorts first (GPT-2's `lm_head.weight`, not `transformer.wte.weight`), and a plain state_dict holds
// every name. So a load takes a tied weight under any of its names, or under several: each rank then reads its
// rows under every name it was saved under and compares them bit for bit, since a file whose copies differ is not
// one tensor (which copy would be the weight?). Which saved names are which model tensor is decided before any
// byte is read, after the user's renaming (SavedNames) and then the aliases; two saved tensors that land on one
// model tensor without being its tie are refused by name.

// For each tensor of `state`, the names in the checkpoint that hold it (one, or several for a tie saved under
// several names); throws std::invalid_argument naming the first difference.
std::vector<std::vector<std::string>> match(const CheckpointIndex& index, const ShardedState& state,
                                            const std::string& skip_prefix, const SavedNames& names) {
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < state.tensors.size(); ++i) position.emplace(state.tensors[i].name, i);
  std::vector<std::vector<std::string>> sources(state.tensors.size());
  std::map<std::string, std::string> taken_as;  // model name -> the saved name that took it
  std::string extra;                            // the first saved tensor the model does not have
  for (const auto& [saved, info] : index.tensors) {
    const std::string model_name = names ? names(saved) : saved;
    if (model_name.empty()) continue;
    const auto alias = state.aliases.find(model_name);
    const std::string name = alias == state.aliases.end() ? model_name : alias->second;
    const auto it = position.find(name);
    if (it == position.end()) {
      const bool skipped = !skip_prefix.empty() && model_name.rfind(skip_prefix, 0) == 0;
      if (!skipped && extra.empty())  // reported after the missing ones, which say more
        extra = "checkpoint '" + index.path + "' holds tensor '" + saved + "'" +
                (model_name != saved ? " (named '" + model_name + "' for this model)" : "") +
                ", which this model does not have: saved from another model?";
      continue;
    }
    const auto [prior, fresh] = taken_as.emplace(model_name, saved);
    if (!fresh)
      throw std::invalid_argument("checkpoint '" + index.path + "' holds '" + prior->second + "' and '" + saved +
                                  "', which are both named '" + model_name + "' for this model");
    const StateTensor& t = state.tensors[it->second];
    if (info.dtype != t.local.scalar_type() || info.sizes != t.full_sizes)
      throw std::invalid_argument("checkpoint '" + index.path + "' holds '" + saved + "' as " +
                                  safetensors::dtype_name(info.dtype) + " " + sizes_text(info.sizes) +
                                  "; this model has " + (name != saved ? "'" + name + "' as " : "") +
                                  safetensors::dtype_name(t.local.scalar_type()) + " " + sizes_text(t.full_sizes));
    sources[it->second].push_back(saved);
  }
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (!sources[i].empty()) continue;
    const std::string& name = state.tensors[i].name;
    std::string tied;
    for (const auto& [alias, of] : state.aliases)
      if (of == name) tied += (tied.empty() ? "" : "', '") + alias;
    throw std::invalid_argument("checkpoint '" + index.path + "' has no tensor '" + name + "'" +
                                (tied.empty() ? "" : " (nor its tied names '" + tied + "')") +
                                (names ? " under the names given for its tensors" : "") + " (it holds " +
                                std::to_string(index.tensors.size()) + " tensors): saved from another model?");
  }
  if (!extra.empty()) throw std::invalid_argument(extra);
  return sources;
}

void check_files(const CheckpointIndex& index) {
  for (const auto& [file, bytes] : index.files) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(file, ec);
    if (ec)
      throw std::runtime_error("file '" + file + "' of checkpoint '" + index.path +
                               "' is missing or unreadable (an incomplete checkpoint): " + ec.message());
    if (size != bytes)
      throw std::runtime_error("file '" + file + "' has " + std::to_string(size) + " bytes; the index recorded " +
                               std::to_string(bytes) + (size < bytes ? " (truncated)" : ""));
  }
}

at::Tensor cpu_contiguous(const at::Tensor& t) { return t.device().is_cpu() ? t.contiguous() : t.cpu().contiguous(); }

c10::Device collective_device(const Communicator& comm, const ShardedState& state) {
  if (comm.kind() != BackendKind::kNccl) return c10::Device(c10::kCPU);
  for (const StateTensor& t : state.tensors)
    if (t.local.is_cuda()) return t.local.device();
  return c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
}

// Note [Full files written one tensor at a time]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A full file holds the whole model, which may not fit in one process (the reason FSDP exists). So neither
// save_full_checkpoint nor export_checkpoint holds it: a safetensors::Writer writes the header first, then one
// tensor at a time in the file's order (the safetensors library's: by dtype, then name), each gathered from the
// ranks (save) or read from the pieces (export) just before, and dropped after. The header needs every tensor's
// CRC-32 (the file's metadata keeps them) before any byte of data: it is combined from the pieces' CRC-32s
// (crc32_concat), which each rank computes over its own rows (save) or the index records (export), so making the
// header reads no tensor. What is written is checked against that CRC-32 as it goes. The file is the one
// write_file would write for the same tensors, byte for byte. What a rank holds at once: its own rows of one
// tensor, padded, and what the all-gather gives every rank (the whole tensor); rank 0 also assembles it. So about
// two tensors, never the model.

// The metadata of a full file: `user`'s, "format": "pt", and every tensor's CRC-32.
std::map<std::string, std::string> full_file_metadata(std::map<std::string, std::string> user,
                                                      const std::vector<safetensors::TensorSpec>& specs,
                                                      const std::vector<uint32_t>& crcs) {
  check_format_key(user);
  user[kFormatKey] = kFormatPt;
  for (size_t i = 0; i < specs.size(); ++i) user[kCrcKey + specs[i].name] = std::to_string(crcs[i]);
  return user;
}

// A tensor's CRC-32 from its pieces' (in row order), each `rows` rows of `row_bytes` bytes.
uint32_t combined_crc(const std::vector<std::pair<uint32_t, int64_t>>& pieces, uint64_t row_bytes) {
  uint32_t crc = 0;
  for (const auto& [piece_crc, rows] : pieces)
    crc = safetensors::crc32_concat(crc, piece_crc, static_cast<uint64_t>(rows) * row_bytes);
  return crc;
}

// Writes the next tensor of `writer`, checked against the CRC-32 the header recorded.
void write_checked(safetensors::Writer& writer, const at::Tensor& t, const std::string& name, uint32_t expected) {
  const uint32_t crc = writer.write(t);
  if (crc != expected)
    throw std::runtime_error("'" + name + "' changed while it was written: its bytes' CRC-32 is " +
                             std::to_string(crc) + ", its pieces' gave " + std::to_string(expected));
}

// Renames a finished staging file onto `file` and flushes the directory.
void put_in_place(const std::string& partial, const std::string& file) {
  if (::rename(partial.c_str(), file.c_str()) != 0)
    throw std::runtime_error("cannot rename '" + partial + "' to '" + file + "': " + std::strerror(errno));
  try {  // the file is in place: a failure to flush its directory must not report the save as failed
    fsync_path(parent_of(file), true);
  } catch (const std::exception& e) {
    warn_once("checkpoint.fsync_file_parent", std::string("full file: ") + e.what() +
                                                  "; the file is in place, but a power loss now may undo the rename");
  }
}

// A staging file removed on destruction unless it was put in place: a failed save or export leaves nothing of its
// own behind, whatever threw. Declared before the Writer that writes it, so the Writer closes it first.
struct StagingFile {
  std::string path;
  bool placed = false;
  explicit StagingFile(std::string p) : path(std::move(p)) {}
  StagingFile(const StagingFile&) = delete;
  StagingFile& operator=(const StagingFile&) = delete;
  ~StagingFile() {
    if (placed) return;
    std::error_code ec;
    fs::remove(path, ec);
  }
};

}  // namespace

std::string file_in_the_way(const std::string& dir) {
  std::error_code ec;
  for (fs::path p = fs::absolute(dir, ec).parent_path(); !p.empty(); p = p.parent_path()) {
    if (fs::exists(p, ec)) return fs::is_directory(p, ec) ? "" : p.string();
    if (p == p.root_path()) break;
  }
  return "";
}

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

void save_checkpoint(const std::string& dir_in, const ShardedState& state_in, Communicator& comm,
                     const PrepareSave& prepare) {
  const std::string dir = without_trailing_slash(dir_in);
  const std::string staging = dir + kStagingSuffix;
  const std::string what = "save_checkpoint('" + dir + "')";
  ShardedState state = state_in;  // tensor handles: prepare may add to it
  try {
    agree(comm, attempt([&] {
            if (prepare) prepare(state);
            check_state(state);
            if (comm.rank() == 0) prepare_staging(dir, staging);
          }),
          what);
  } catch (...) {
    std::error_code ec;
    if (comm.rank() == 0) fs::remove_all(staging, ec);  // made before another rank's refusal came in
    throw;
  }

  std::string description;
  const Outcome wrote = attempt([&] {
    const auto pieces = saved_pieces(state);
    std::string file;
    uint64_t bytes = 0;
    std::vector<uint32_t> crcs;
    if (!pieces.empty()) {
      file = rank_file(comm.rank(), comm.size());
      crcs = safetensors::write_file(staging + "/" + file, pieces);
      bytes = fs::file_size(staging + "/" + file);
    }
    description = describe(state, file, bytes, crcs).dump();
  });
  const std::vector<std::string> all = all_gather_text(comm, wrote.kind ? wrote.text() : "D" + description);

  Outcome committed;
  if (comm.rank() == 0) {
    committed = attempt([&] {
      std::vector<nlohmann::json> ranks;
      for (size_t r = 0; r < all.size(); ++r) {
        if (all[r][0] == 'D') {
          ranks.push_back(nlohmann::json::parse(all[r].substr(1)));
          continue;
        }
        const std::string message = "rank " + std::to_string(r) + ": " + all[r].substr(1);
        if (all[r][0] == 'I') throw std::invalid_argument(message);
        throw std::runtime_error(message);
      }
      write_text_file(staging + "/" + kIndexName, build_index(ranks, state.metadata).dump(1) + "\n");
      fsync_path(staging, true);
      swap_into_place(staging, dir);
    });
    if (committed.kind) {
      std::error_code ec;
      fs::remove_all(staging, ec);
    }
  }
  agree(comm, committed, what);
}

void load_checkpoint(const std::string& path, ShardedState& state, Communicator& comm, const std::string& skip_prefix,
                     const PrepareLoad& prepare, const SavedNames& names) {
  CheckpointIndex index;
  std::vector<at::Tensor> staged;
  const Outcome read = attempt([&] {
    index = read_checkpoint_index(path);
    if (prepare) prepare(index, state);
    check_state(state);
    const std::vector<std::vector<std::string>> sources = match(index, state, skip_prefix, names);
    staged.resize(state.tensors.size());
    check_files(index);
    Pieces pieces;
    size_t k = 0;
    for (const auto& [name, saved] : index.tensors)
      for (const SavedPiece& piece : saved.pieces)
        if (piece.has_crc && static_cast<int>(k++ % comm.size()) == comm.rank()) pieces.check_crc(name, saved, piece);
    for (size_t i = 0; i < state.tensors.size(); ++i) {
      const StateTensor& t = state.tensors[i];
      staged[i] = at::empty(t.local.sizes(), at::TensorOptions().dtype(t.local.scalar_type()));
      const std::string& first = sources[i].front();
      pieces.read_rows(first, index.tensors.at(first), t.first_row, staged[i]);
      for (size_t k = 1; k < sources[i].size(); ++k) {  // a tie saved under several names: the same values
        const at::Tensor copy = at::empty_like(staged[i]);
        pieces.read_rows(sources[i][k], index.tensors.at(sources[i][k]), t.first_row, copy);
        if (!equal_bytes(copy, staged[i]))
          throw std::invalid_argument("checkpoint '" + index.path + "' holds the tied weight '" + t.name + "' as '" +
                                      first + "' and as '" + sources[i][k] + "', with different values (in rows [" +
                                      std::to_string(t.first_row) + ", " + std::to_string(t.first_row + local_rows(t)) +
                                      "), half-open): which one is the weight?");
      }
    }
  });
  agree(comm, read, "load_checkpoint('" + path + "')");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < state.tensors.size(); ++i) state.tensors[i].local.copy_(staged[i]);
  state.metadata = index.metadata;
}

void save_full_checkpoint(const std::string& file, const ShardedState& state, Communicator& comm) {
  const std::string what = "save_full_checkpoint('" + file + "')";
  // Each rank's rows of every tensor it saves, and their CRC-32 (Note [Full files written one tensor at a time]).
  std::vector<uint32_t> my_crcs;
  agree(comm, attempt([&] {
          check_state(state);
          for (const StateTensor& t : state.tensors) {
            if (!t.saves || local_rows(t) == 0) continue;
            const at::Tensor c = cpu_contiguous(t.local);
            my_crcs.push_back(safetensors::crc32(c.data_ptr(), c.numel() * c.element_size()));
          }
        }),
        what);
  // Which rows each rank saves, on every rank: the layout of each tensor's gather.
  const std::vector<std::string> all = all_gather_text(comm, describe(state, "", 0, my_crcs).dump());
  std::vector<nlohmann::json> ranks;
  ranks.reserve(all.size());
  for (const std::string& text : all) ranks.push_back(nlohmann::json::parse(text));
  nlohmann::json index;
  agree(comm, attempt([&] { index = build_index(ranks, {}); }), what);

  std::vector<safetensors::TensorSpec> specs;
  std::vector<uint32_t> crcs;
  for (const StateTensor& t : state.tensors) {
    specs.push_back({t.name, t.local.scalar_type(), t.full_sizes});
    std::vector<std::pair<uint32_t, int64_t>> pieces;
    for (const auto& p : index["tensors"][t.name]["pieces"]) pieces.emplace_back(p["crc32"], p["rows"][1]);
    crcs.push_back(combined_crc(pieces, row_numel(t.full_sizes) * t.local.element_size()));
  }
  StagingFile partial(file + kStagingSuffix);  // rank 0's
  std::unique_ptr<safetensors::Writer> writer;
  Outcome assembled;  // rank 0's first failure: it keeps issuing every gather, and the last agreement reports it
  if (comm.rank() == 0)
    assembled = attempt([&] {
      writer =
          std::make_unique<safetensors::Writer>(partial.path, specs, full_file_metadata(state.metadata, specs, crcs));
    });
  const c10::Device device = collective_device(comm, state);
  for (const size_t i : safetensors::layout_order(specs)) {  // the file's order, on every rank
    const StateTensor& t = state.tensors[i];
    std::vector<int64_t> first(comm.size(), 0);
    std::vector<int64_t> rows(comm.size(), 0);
    int savers = 0;
    for (int r = 0; r < comm.size(); ++r) {
      const nlohmann::json& e = ranks[r]["tensors"][i];
      if (!e.contains("rows")) continue;
      first[r] = e["rows"][0];
      rows[r] = e["rows"][1];
      ++savers;
    }
    const int64_t most = *std::max_element(rows.begin(), rows.end());
    const int64_t per_row = row_numel(t.full_sizes);
    const auto cpu = at::TensorOptions().dtype(t.local.scalar_type());
    const auto write = [&](const at::Tensor& whole) {
      if (comm.rank() == 0 && !assembled.kind)
        assembled = attempt([&] { write_checked(*writer, whole, t.name, crcs[i]); });
    };
    // The same decision on every rank (from what every rank gathered): when rank 0 holds it all, or it has no
    // element, no collective.
    if ((savers == 1 && rows[0] > 0) || most * per_row == 0) {
      if (comm.rank() == 0) write(savers == 1 && rows[0] > 0 ? t.local : at::empty(t.full_sizes, cpu));
      continue;
    }
    // Gathered as bytes, whatever the dtype: Gloo carries neither bool nor int16 (nor, in 1.13, bfloat16), and
    // bytes travel exactly.
    const int64_t elem = static_cast<int64_t>(t.local.element_size());
    const auto options = at::TensorOptions().dtype(at::kByte).device(device);
    at::Tensor mine = at::zeros({most * per_row * elem}, options);
    const int64_t my_rows = rows[comm.rank()];
    if (my_rows > 0)
      mine.narrow(0, 0, my_rows * per_row * elem).copy_(t.local.contiguous().reshape({-1}).view(at::kByte));
    at::Tensor gathered = at::empty({comm.size() * most * per_row * elem}, options);
    comm.all_gather(gathered, mine).wait();
    mine.reset();
    if (comm.rank() != 0 || assembled.kind) continue;
    at::Tensor whole;
    assembled = attempt([&] {
      const at::Tensor blocks = gathered.cpu().view(t.local.scalar_type());
      gathered.reset();
      whole = at::empty(t.full_sizes, cpu);
      at::Tensor flat = whole.view({-1});
      for (int r = 0; r < comm.size(); ++r)
        if (rows[r] > 0)
          flat.narrow(0, first[r] * per_row, rows[r] * per_row)
              .copy_(blocks.narrow(0, r * most * per_row, rows[r] * per_row));
    });
    if (!assembled.kind) write(whole);
  }
  Outcome wrote = assembled;
  if (comm.rank() == 0 && !wrote.kind)
    wrote = attempt([&] {
      writer->finish();
      writer.reset();
      put_in_place(partial.path, file);
      partial.placed = true;
    });
  writer.reset();  // closed before `partial` removes a file not put in place
  agree(comm, wrote, what);
}

void export_checkpoint(const std::string& dir, const std::string& file, bool optimizer_state) {
  const CheckpointIndex index = read_checkpoint_index(dir);
  check_files(index);
  // Every piece of the checkpoint checked first (also what is not exported), one piece read at a time; then each
  // exported tensor read and written, one at a time (Note [Full files written one tensor at a time]).
  Pieces pieces;
  std::vector<safetensors::TensorSpec> specs;
  std::vector<uint32_t> crcs;
  for (const auto& [name, saved] : index.tensors) {
    for (const SavedPiece& piece : saved.pieces)
      if (piece.has_crc) pieces.check_crc(name, saved, piece);
    if (!optimizer_state && name.rfind("optim.", 0) == 0) continue;
    specs.push_back({name, saved.dtype, saved.sizes});
    const uint64_t row_bytes = static_cast<uint64_t>(row_numel(saved.sizes)) * c10::elementSize(saved.dtype);
    std::vector<std::pair<uint32_t, int64_t>> parts;
    for (const SavedPiece& piece : saved.pieces)  // a file shardlab did not write has none: read it for one
      parts.emplace_back(piece.has_crc ? piece.crc32 : pieces.reader(piece.file).crc32(name), piece.rows);
    crcs.push_back(combined_crc(parts, row_bytes));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : index.metadata)
    if (optimizer_state || key.rfind("optim.", 0) != 0) metadata.emplace(key, value);
  StagingFile partial(file + kStagingSuffix);
  {
    safetensors::Writer writer(partial.path, specs, full_file_metadata(metadata, specs, crcs));
    for (const size_t i : writer.order()) {
      const SavedTensor& saved = index.tensors.at(specs[i].name);
      at::Tensor whole = at::empty(saved.sizes, at::TensorOptions().dtype(saved.dtype));
      pieces.read_rows(specs[i].name, saved, 0, whole);
      write_checked(writer, whole, specs[i].name, crcs[i]);
    }
    writer.finish();
  }
  put_in_place(partial.path, file);
  partial.placed = true;
}

}  // namespace shardlab
