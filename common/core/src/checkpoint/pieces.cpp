// A tensor's rows and the saved pieces read back: every tensor is split into pieces of rows (dim 0), and a
// checkpoint's index names, for each piece, the file that holds it, its rows and its CRC-32. Here are the sizes of
// rows and pieces that every part of the checkpoint code speaks in, the check that every file of a checkpoint is on
// the disk with the size its index recorded, and Pieces, which opens the files, checks each piece against the index
// (dtype, shape, CRC-32) and reads only the rows a caller asks for. Used by a load (each rank reads the rows that
// overlap its own) and by an export (every tensor whole).

#include "detail/checkpoint_internal.h"

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/checkpoint/safetensors.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace shardlab {

namespace fs = std::filesystem;

int64_t detail::rows_in(const std::vector<int64_t>& sizes) { return sizes.empty() ? 1 : sizes.front(); }

int64_t detail::row_numel(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (size_t d = 1; d < sizes.size(); ++d) n *= sizes[d];
  return n;
}

int64_t detail::local_rows(const StateTensor& t) { return t.full_sizes.empty() ? 1 : t.local.size(0); }

std::vector<int64_t> detail::piece_sizes(const std::vector<int64_t>& full, int64_t rows) {
  std::vector<int64_t> s = full;
  if (!s.empty()) s.front() = rows;
  return s;
}

std::string detail::sizes_text(const std::vector<int64_t>& s) { return c10::str(c10::IntArrayRef(s)); }

void detail::check_files(const CheckpointIndex& index) {
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

const safetensors::Reader& detail::Pieces::reader(const std::string& file) {
  auto it = readers_.find(file);
  if (it == readers_.end()) it = readers_.emplace(file, std::make_unique<safetensors::Reader>(file)).first;
  return *it->second;
}

const safetensors::TensorInfo& detail::Pieces::info(const std::string& name, const SavedTensor& saved,
                                                    const SavedPiece& piece) {
  const safetensors::TensorInfo& i = reader(piece.file).info(name);
  if (i.dtype != saved.dtype || i.shape != piece_sizes(saved.sizes, piece.rows))
    throw std::runtime_error("file '" + piece.file + "' holds '" + name + "' as " + safetensors::dtype_name(i.dtype) +
                             " " + sizes_text(i.shape) + "; the index says " + safetensors::dtype_name(saved.dtype) +
                             " " + sizes_text(piece_sizes(saved.sizes, piece.rows)) +
                             " (a mixed or corrupt checkpoint)");
  return i;
}

void detail::Pieces::check_crc(const std::string& name, const SavedTensor& saved, const SavedPiece& piece) {
  info(name, saved, piece);
  const uint32_t crc = reader(piece.file).crc32(name);
  if (crc != piece.crc32)
    // A full file records its CRC-32s in its own metadata; a sharded checkpoint, in its index.json.
    throw std::runtime_error(
        "file '" + piece.file + "' is corrupt: the CRC-32 of '" + name + "' (rows [" + std::to_string(piece.first_row) +
        ", " + std::to_string(piece.first_row + piece.rows) + "), half-open) is " + std::to_string(crc) + ", " +
        (piece.crc_in_file ? "the file's metadata" : "the index") + " recorded " + std::to_string(piece.crc32));
}

void detail::Pieces::read_rows(const std::string& name, const SavedTensor& saved, int64_t first,
                               const at::Tensor& dst) {
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

}  // namespace shardlab
