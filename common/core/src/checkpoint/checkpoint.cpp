// The collective sharded save and load: save_checkpoint, where every rank writes its pieces into a staging directory
// and rank 0 writes the index and puts the directory in place once every rank's file is on the disk (Note [Saving
// so that nothing is lost]), and load_checkpoint, where every rank checks the checkpoint and reads the rows it
// holds before any rank changes its state (Note [Loading all or nothing]). Here too is how the ranks agree on an
// outcome, so that every rank throws the same error. The index format (index.cpp), the staging directory
// (atomic.cpp), the pieces read back (pieces.cpp) and the matching of a state with a checkpoint (state_match.cpp)
// are their own files.

#include "shardlab/core/checkpoint/checkpoint.h"

#include "detail/checkpoint_internal.h"

#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/comm/text_gather.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

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

using detail::agree;
using detail::attempt;
using detail::build_index;
using detail::check_files;
using detail::check_state;
using detail::describe;
using detail::fsync_path;
using detail::kIndexName;
using detail::kStagingSuffix;
using detail::local_rows;
using detail::match;
using detail::Outcome;
using detail::Pieces;
using detail::prepare_staging;
using detail::swap_into_place;
using detail::without_trailing_slash;
using detail::write_text_file;

namespace {

// Whether two contiguous CPU tensors of one dtype and size hold the same bytes (NaNs by their bits).
bool equal_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return true;  // no rows here (data_ptr may be null)
  return std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0;
}

std::string rank_file(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

std::vector<std::pair<std::string, at::Tensor>> saved_pieces(const ShardedState& state) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const StateTensor& t : state.tensors)
    if (t.saves && local_rows(t) > 0) out.emplace_back(t.name, t.local);
  return out;
}

}  // namespace

// All-gathers every rank's outcome; throws the lowest rank's error on every rank.
void detail::agree(Communicator& comm, const Outcome& mine, const std::string& what) {
  const std::vector<std::string> all = all_gather_text(comm, mine.text());
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const std::string message =
        what + ": " + (comm.size() > 1 ? "rank " + std::to_string(r) + ": " : "") + all[r].substr(1);
    if (all[r][0] == 'I') throw std::invalid_argument(message);
    throw std::runtime_error(message);
  }
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
      // A tie saved under several names: the same values (Note [A tied weight in a file] in state_match.cpp).
      for (size_t k = 1; k < sources[i].size(); ++k) {
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

}  // namespace shardlab
