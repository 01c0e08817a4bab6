// Full files and export: a full checkpoint is one safetensors file with every tensor whole, under its full name,
// that a single-device program, Hugging Face's tools or numpy read. save_full_checkpoint gathers each tensor from
// the ranks to rank 0, export_checkpoint reads it from a sharded checkpoint's pieces; both stream the file one
// tensor at a time, its header (with every tensor's CRC-32, combined from the pieces') written first (Note [Full
// files written one tensor at a time]), into a staging file put in place when complete. The "format": "pt" key
// Hugging Face requires of such a file is reserved here.

#include "shardlab/core/checkpoint/checkpoint.h"

#include "detail/checkpoint_internal.h"

#include "shardlab/core/checkpoint/safetensors.h"
#include "shardlab/core/comm/text_gather.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace shardlab {

using detail::agree;
using detail::attempt;
using detail::build_index;
using detail::check_files;
using detail::check_format_key;
using detail::check_state;
using detail::describe;
using detail::kCrcKey;
using detail::kFormatKey;
using detail::kFormatPt;
using detail::kStagingSuffix;
using detail::local_rows;
using detail::Outcome;
using detail::Pieces;
using detail::put_in_place;
using detail::row_numel;
using detail::StagingFile;

// The metadata key kFormatKey is the file format's (Hugging Face's "pt"): a user's metadata may not give it another
// value, checked when a save starts (a sharded checkpoint exports to a full file).
void detail::check_format_key(const std::map<std::string, std::string>& metadata) {
  const auto format = metadata.find(kFormatKey);
  if (format != metadata.end() && format->second != kFormatPt)
    throw std::invalid_argument("metadata key '" + std::string(kFormatKey) + "' is '" + format->second +
                                "'; it is reserved for \"" + kFormatPt +
                                "\" in a full safetensors file, which Hugging Face's transformers requires: keep your "
                                "value under another key");
}

namespace {

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

// `t` as a contiguous CPU tensor (itself when it is one).
at::Tensor cpu_contiguous(const at::Tensor& t) { return t.device().is_cpu() ? t.contiguous() : t.cpu().contiguous(); }

// Where save_full_checkpoint's all-gathers run: a CUDA device under NCCL (a state tensor's), else the CPU.
c10::Device collective_device(const Communicator& comm, const ShardedState& state) {
  if (comm.kind() != BackendKind::kNccl) return c10::Device(c10::kCPU);
  for (const StateTensor& t : state.tensors)
    if (t.local.is_cuda()) return t.local.device();
  return c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
}

}  // namespace

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
