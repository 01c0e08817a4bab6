#pragma once
/// @file checkpoint.h
/// Checkpoints that every wrapper writes and reads, at any world size (PyTorch's distributed checkpoint, DCP, in
/// spirit; Hugging Face's safetensors in format). The format is in docs/checkpoints.md.
///
/// Vocabulary:
///  - *state*: the named tensors a training run needs to go on (the model's parameters and buffers, the optimizer's
///    moments), each held by the ranks in *pieces*: a range of rows (dim 0) of the full tensor. A replicated tensor
///    is one piece, all of it, on every rank (one of them saves it); an FSDP parameter is one piece per rank, its
///    real rows (never the padding).
///  - *sharded checkpoint*: a directory with one safetensors file per rank that saves anything
///    (`rank-00001-of-00004.safetensors`, its pieces under their full names) and `index.json`, written last, which
///    says for every tensor its dtype, full shape, and which rows each file holds with their CRC-32.
///  - *full checkpoint*: one safetensors file with every tensor whole, under its full name: what a single-device
///    program, Hugging Face's `load_file` or numpy read (see save_full_checkpoint and export_checkpoint).
///
/// Every checkpoint can be loaded at any world size: each rank reads only the rows of the saved pieces that
/// overlap its own. See Note [Saving so that nothing is lost] and Note [Loading all or nothing] in checkpoint.cpp.

#include "shardlab/core/comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace shardlab {

/// One tensor of a state, as this rank holds it.
struct StateTensor {
  std::string name;                 ///< the full name ("block0.fc.weight"; "optim.block0.fc.weight.exp_avg")
  at::Tensor local;                 ///< this rank's rows [first_row, first_row + local.size(0)) of the full
                                    ///< tensor (all of it when not sharded); save reads it, load writes into it
  std::vector<int64_t> full_sizes;  ///< the full tensor's sizes (empty for a 0-dim tensor, which is never split)
  int64_t first_row = 0;            ///< where this rank's rows start in the full tensor
  bool saves = true;                ///< false on a rank whose rows another rank saves (a replica)
};

/// A state as the ranks hold it: what save_checkpoint writes and load_checkpoint fills.
struct ShardedState {
  std::vector<StateTensor> tensors;             ///< in any order; names unique
  std::map<std::string, std::string> metadata;  ///< strings saved alongside (the step, the data position, ...)
  /// Other names of a tensor in `tensors` (a tied weight's later registrations, model.h's tied_names) mapped to
  /// its name there. A save writes the tensor once, under its name; a load takes it under any of its names, or
  /// under several, which must then hold the same values (Note [A tied weight in a file]).
  std::map<std::string, std::string> aliases;
};

/// How a load names what a file holds: given a saved tensor's name, the name of the model's tensor it is ("" to
/// leave it out of the load). Empty: the saved names are the model's. For a file whose names are not the model's,
/// such as Hugging Face's dotted `layers.0.mlp.fc.weight` where a shardlab unit is `layers_0` (a libtorch
/// submodule's name holds no dot), or a prefix (`model.`) the model does not have.
using SavedNames = std::function<std::string(const std::string& saved_name)>;

/// One piece of a saved tensor: rows [first_row, first_row + rows) held by `file`.
struct SavedPiece {
  std::string file;          ///< the file's path
  int64_t first_row = 0;     ///< its first row of the full tensor
  int64_t rows = 0;          ///< its rows (1 for a 0-dim tensor)
  bool has_crc = false;      ///< false for a safetensors file shardlab did not write (no CRC to check)
  uint32_t crc32 = 0;        ///< the CRC-32 of the piece's bytes, as the index records it
  bool crc_in_file = false;  ///< the CRC-32 came from the file's own metadata (a full file), not an index.json
};

/// One saved tensor: what the checkpoint holds of it.
struct SavedTensor {
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< its dtype
  std::vector<int64_t> sizes;                      ///< the full tensor's sizes
  std::vector<SavedPiece> pieces;                  ///< ordered by first row; they tile the rows exactly
};

/// What a checkpoint holds, from its index (a sharded checkpoint) or its header (a full one).
struct CheckpointIndex {
  std::string path;                             ///< the checkpoint's directory or file
  int world_size = 1;                           ///< the ranks that saved it (1 for a full checkpoint)
  std::map<std::string, SavedTensor> tensors;   ///< by full name
  std::map<std::string, uint64_t> files;        ///< every file's path and size in bytes
  std::map<std::string, std::string> metadata;  ///< ShardedState::metadata as saved
};

/// Reads what the checkpoint at `path` holds, without reading any tensor: a directory with `index.json` (a sharded
/// checkpoint) or a safetensors file (a full checkpoint, or any safetensors file: one piece per tensor). No
/// collective.
/// @throws std::runtime_error naming the file when it is missing, unreadable or malformed.
CheckpointIndex read_checkpoint_index(const std::string& path);

/// The nearest ancestor of `dir` that exists, when it is not a directory (a regular file in the way of making
/// `dir`); "" when the nearest existing ancestor is a directory. A save checks it first, so that the error names
/// the file instead of a staging path std::filesystem could not make.
std::string file_in_the_way(const std::string& dir);

/// What save_checkpoint calls on every rank, first, with its copy of the state: it may add to it (an optimizer's
/// state) or throw std::invalid_argument, which every rank then throws before anything is written.
using PrepareSave = std::function<void(ShardedState& state)>;

/// Saves `state` as a sharded checkpoint in directory `dir`, replacing the checkpoint there atomically: until the
/// save has completed on every rank, `dir` holds the previous checkpoint, whole (Note [Saving so that nothing is
/// lost]). Every rank of `comm` calls it with its part of the same state (the same names, dtypes and full sizes on
/// every rank; the rows saved by all ranks tile each tensor exactly once). The ranks must share a filesystem.
/// A collective over `comm` (a few small all-gathers of text).
/// @param dir the checkpoint's directory.
/// @param state this rank's part of the state.
/// @param comm every rank that saves.
/// @param prepare called first with a copy of `state` (see PrepareSave); empty: nothing.
/// @throws std::invalid_argument on every rank when a rank's state is malformed, `dir` is a directory that is not
///         a shardlab checkpoint (before anything is written), or the ranks' pieces do not tile the tensors or
///         disagree across ranks (after the ranks wrote into the staging directory, which is removed);
///         std::runtime_error on every rank naming the file when a rank cannot write. `dir` is untouched then.
void save_checkpoint(const std::string& dir, const ShardedState& state, Communicator& comm,
                     const PrepareSave& prepare = {});

/// What load_checkpoint calls on every rank once it has read the checkpoint's index, before it matches the index
/// with the state: it may add tensors to the state (destinations for what the checkpoint holds, such as an
/// optimizer's moments) or throw std::invalid_argument, which every rank then throws.
using PrepareLoad = std::function<void(const CheckpointIndex& index, ShardedState& state)>;

/// Loads the checkpoint at `path` (a sharded checkpoint's directory, or a safetensors file) into `state`: every
/// tensor's `local` gets its rows, and `state.metadata` the saved metadata. Each rank reads only the saved rows
/// that overlap its own, so the checkpoint may have been saved at any world size. All or nothing: every check runs
/// on every rank before any `local` changes (Note [Loading all or nothing]).
/// @param path the checkpoint.
/// @param state the tensors to fill (names, full sizes, dtypes and rows as this rank holds them).
/// @param comm every rank that loads; a collective over it.
/// @param skip_prefix saved tensors whose names start with it may be absent from `state` (e.g. "optim." when no
///        optimizer is loaded); empty: every saved tensor must be in `state`.
/// @param prepare called with the index before anything is matched (see PrepareLoad); empty: nothing.
/// @param names the model's name of each saved tensor (see SavedNames); empty: the saved names.
/// @throws std::invalid_argument on every rank when the checkpoint does not match `state` (a tensor missing or
///         extra, another dtype or shape, two saved tensors named as one, a tied weight saved under two names with
///         different values); std::runtime_error on every rank naming the file when a file is missing, truncated
///         or corrupt (a CRC-32 differs). Nothing in `state` has changed then.
void load_checkpoint(const std::string& path, ShardedState& state, Communicator& comm,
                     const std::string& skip_prefix = "", const PrepareLoad& prepare = {},
                     const SavedNames& names = {});

/// Saves `state` as a full checkpoint: one safetensors file at `file`, every tensor whole, written by rank 0 (the
/// other ranks send it their rows) through a temporary file and a rename. The metadata and every tensor's CRC-32
/// go into the file's "__metadata__". One tensor at a time: a rank holds about two tensors at once (its rows and
/// what the all-gather gives it), never the model (Note [Full files written one tensor at a time]), so a model
/// larger than one rank can be saved whole. A collective over `comm`.
/// @throws as save_checkpoint.
void save_full_checkpoint(const std::string& file, const ShardedState& state, Communicator& comm);

/// Writes the sharded checkpoint in `dir` as one full checkpoint `file`, in one process, through a temporary file
/// and a rename, one tensor at a time (it holds about one tensor, never the model); every piece of the checkpoint
/// is checked against its CRC-32 first (also those not exported), so a successful export says the whole
/// checkpoint is sound. No collective.
/// @param dir the sharded checkpoint (or a full one).
/// @param file the safetensors file to write.
/// @param optimizer_state false: the model's tensors only (what a single-device program or Hugging Face's tools
///        load), leaving out those whose names start with "optim."; true: every tensor.
/// @throws std::runtime_error naming the file that is missing, truncated or corrupt.
void export_checkpoint(const std::string& dir, const std::string& file, bool optimizer_state = false);

}  // namespace shardlab
