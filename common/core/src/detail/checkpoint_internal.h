#pragma once
// Internal to shardlab::core (not installed): what the checkpoint's source files (src/checkpoint/) share. Each holds
// one concept: checkpoint.cpp the collective sharded save and load, index.cpp the index format, atomic.cpp the
// staging directories and files put in place, pieces.cpp a tensor's rows and the saved pieces read back,
// state_match.cpp a state checked on its own and matched with a checkpoint, full_file.cpp full files and export.
// Each group below says which file defines it.

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::detail {

// --- Names a checkpoint's files and keys use.

/// A sharded checkpoint's index, the last file a save writes into its directory.
inline constexpr const char* kIndexName = "index.json";
/// Full checkpoints: the "__metadata__" key of a tensor's CRC-32, followed by the tensor's name.
inline constexpr const char* kCrcKey = "shardlab.crc32.";
/// Full files: the "__metadata__" key Hugging Face's transformers requires, and the value it requires for PyTorch's
/// tensors (it refuses a safetensors file whose metadata lacks it). Written into every full file; a user's metadata
/// may not give it another value, and a load does not hand it back as the user's.
inline constexpr const char* kFormatKey = "format";
inline constexpr const char* kFormatPt = "pt";  ///< kFormatKey's value
/// The save's own siblings of a checkpoint (names no user picks by chance: they are removed without asking): the
/// staging directory or file, and where a save that cannot exchange directories moves the previous checkpoint.
inline constexpr const char* kStagingSuffix = ".shardlab-partial";
inline constexpr const char* kOldSuffix = ".shardlab-old";  ///< read_checkpoint_index falls back to it

// --- Errors every rank throws alike (checkpoint.cpp).

/// An error every rank throws alike: 'I' std::invalid_argument, 'R' std::runtime_error.
struct Outcome {
  char kind = 0;
  std::string message;
  std::string text() const { return kind ? std::string(1, kind) + message : std::string(); }
};

/// All-gathers every rank's outcome; throws the lowest rank's error on every rank. A collective over `comm`.
void agree(Communicator& comm, const Outcome& mine, const std::string& what);

/// Runs `f`; what it throws as an Outcome (an empty one when it returns).
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

// --- The index format (index.cpp).

/// What one rank wrote (save step 2), as JSON: every tensor's dtype and sizes, and the piece it saved from `file`
/// (`bytes` long) with its CRC-32 (`crcs`, one per piece saved, in the state's order).
nlohmann::json describe(const ShardedState& state, const std::string& file, uint64_t bytes,
                        const std::vector<uint32_t>& crcs);

/// Rank 0, save step 3: the index from every rank's description; throws std::invalid_argument when the ranks
/// disagree or the pieces do not tile a tensor.
nlohmann::json build_index(const std::vector<nlohmann::json>& ranks, const std::map<std::string, std::string>& meta);

// --- Staging directories and files put in place (atomic.cpp).

/// Flushes the file or directory at `path` to the disk; std::runtime_error naming it when it cannot.
void fsync_path(const std::string& path, bool directory);

/// Writes `text` as the file at `path` and flushes it to the disk; std::runtime_error naming it when it cannot.
void write_text_file(const std::string& path, const std::string& text);

/// `dir` without its trailing slashes ("/" stays "/").
std::string without_trailing_slash(std::string dir);

/// Puts `staging` where `dir` is, in one step where the filesystem can (Note [Saving so that nothing is lost] in
/// checkpoint.cpp).
void swap_into_place(const std::string& staging, const std::string& dir);

/// Rank 0, save step 1: a fresh staging directory; `dir` must be a checkpoint or absent (else std::invalid_argument).
void prepare_staging(const std::string& dir, const std::string& staging);

/// Renames a finished staging file onto `file` and flushes the directory.
void put_in_place(const std::string& partial, const std::string& file);

/// A staging file removed on destruction unless it was put in place: a failed save or export leaves nothing of its
/// own behind, whatever threw. Declared before the Writer that writes it, so the Writer closes it first.
struct StagingFile {
  std::string path;
  bool placed = false;
  explicit StagingFile(std::string p) : path(std::move(p)) {}
  StagingFile(const StagingFile&) = delete;
  StagingFile& operator=(const StagingFile&) = delete;
  ~StagingFile();  ///< removes `path` unless `placed`
};

// --- A tensor's rows, and the saved pieces read back (pieces.cpp).

/// The rows of a tensor of `sizes` (1 for a 0-dim tensor).
int64_t rows_in(const std::vector<int64_t>& sizes);

/// The elements in one row of a tensor of `sizes`.
int64_t row_numel(const std::vector<int64_t>& sizes);

/// The rows `t` holds of its full tensor (1 for a 0-dim tensor).
int64_t local_rows(const StateTensor& t);

/// The sizes of rows [.., .. + rows) of a tensor of `full` sizes.
std::vector<int64_t> piece_sizes(const std::vector<int64_t>& full, int64_t rows);

/// `s` as text, as c10 prints sizes ("[2, 3]").
std::string sizes_text(const std::vector<int64_t>& s);

/// Checks that every file of `index` exists with the size the index recorded; std::runtime_error naming the file.
void check_files(const CheckpointIndex& index);

/// Open readers, one per file, checked against the index's view of each piece.
class Pieces {
 public:
  Pieces() = default;

  /// The reader of `file`, opened on first use.
  const safetensors::Reader& reader(const std::string& file);

  /// The piece's entry in its file, checked against the index.
  const safetensors::TensorInfo& info(const std::string& name, const SavedTensor& saved, const SavedPiece& piece);

  /// Checks the CRC-32 of the piece's bytes against what the index (or the file's metadata) recorded.
  void check_crc(const std::string& name, const SavedTensor& saved, const SavedPiece& piece);

  /// Rows [first, first + dst.size(0)) of saved tensor `name` into `dst` (contiguous CPU, the saved dtype).
  void read_rows(const std::string& name, const SavedTensor& saved, int64_t first, const at::Tensor& dst);

 private:
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers_;
};

// --- A state checked on its own and matched with a checkpoint (state_match.cpp).

/// Checks one rank's state on its own: names unique, every local a piece of its full sizes, aliases naming a tensor,
/// the metadata's kFormatKey; std::invalid_argument naming the first fault.
void check_state(const ShardedState& state);

/// For each tensor of `state`, the names in the checkpoint that hold it (one, or several for a tie saved under
/// several names; Note [A tied weight in a file]); throws std::invalid_argument naming the first difference.
std::vector<std::vector<std::string>> match(const CheckpointIndex& index, const ShardedState& state,
                                            const std::string& skip_prefix, const SavedNames& names);

// --- Full files (full_file.cpp).

/// Throws std::invalid_argument when `metadata` gives kFormatKey another value than kFormatPt.
void check_format_key(const std::map<std::string, std::string>& metadata);

}  // namespace shardlab::detail
