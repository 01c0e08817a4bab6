#pragma once
/// @file safetensors.h
/// The safetensors file format (Hugging Face's): what shardlab's checkpoints are made of, so that Hugging Face's
/// `safetensors.torch.load_file`, numpy and a single-device program read them (see docs/checkpoints.md).
///
/// A file is: 8 bytes, the header's length N as a little-endian uint64; N bytes of JSON,
/// `{"__metadata__": {"key": "value", ...}, "name": {"dtype": "F32", "shape": [4, 8], "data_offsets": [b, e]}, ...}`;
/// then the data section: every tensor's bytes, C order, little-endian, at [b, e) from the section's start. The
/// tensors tile the section with no gap and no overlap. Nothing else: no alignment beyond the header's padding,
/// no compression. See Note [What a safetensors reader refuses].

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardlab::safetensors {

/// One tensor of a file, as its header describes it.
struct TensorInfo {
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< the element type ("F32" in the file)
  std::vector<int64_t> shape;                      ///< sizes; empty for a 0-dim tensor
  uint64_t begin = 0;                              ///< first byte in the data section
  uint64_t end = 0;                                ///< one past its last byte
};

/// A file's header, checked.
struct Header {
  std::map<std::string, TensorInfo> tensors;    ///< by name
  std::map<std::string, std::string> metadata;  ///< the "__metadata__" strings (empty when absent)
  uint64_t data_start = 0;                      ///< byte of the file where the data section starts (8 + N)
  uint64_t file_bytes = 0;                      ///< the file's size
};

/// The format's name of `dtype` ("F32", "BF16", "I64", ...).
/// @throws std::invalid_argument for a dtype safetensors has no name for (complex, quantized).
std::string dtype_name(c10::ScalarType dtype);

/// The dtype the format calls `name`.
/// @throws std::invalid_argument naming `name` and the accepted names.
c10::ScalarType dtype_of(const std::string& name);

/// CRC-32 (zlib's, as Python's `zlib.crc32`) of `bytes` bytes at `data`, continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t bytes, uint32_t crc = 0);

/// Writes `tensors` (name, tensor; any device, any strides: each is copied to contiguous CPU memory as needed)
/// and `metadata` to `path`, laid out as the safetensors library lays a file out (by dtype, highest alignment
/// first, then by name; each tensor's data aligned to its element size), then flushes the file to the disk (fsync).
/// @return the CRC-32 of each tensor's bytes, in the given order.
/// @throws std::invalid_argument for a duplicate or empty name, a name "__metadata__", an undefined tensor or an
///         unsupported dtype, before the file is created; std::runtime_error naming the file when the system
///         refuses a write.
std::vector<uint32_t> write_file(const std::string& path,
                                 const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                 const std::map<std::string, std::string>& metadata = {});

/// An open safetensors file whose header was read and checked. Reads any byte range of any tensor.
/// Not copyable; movable.
class Reader {
 public:
  /// Opens `path` and checks its header (Note [What a safetensors reader refuses]).
  /// @throws std::runtime_error naming the file and what is wrong with it.
  explicit Reader(const std::string& path);
  ~Reader();
  /// Takes `other`'s open file; `other` is left closed.
  Reader(Reader&& other) noexcept;
  /// Closes this reader's file and takes `other`'s; `other` is left closed.
  Reader& operator=(Reader&& other) noexcept;
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  /// The file's path, as given.
  const std::string& path() const { return path_; }
  /// The checked header.
  const Header& header() const { return header_; }
  /// The entry of tensor `name`. @throws std::runtime_error naming the file and the tensor when it has none.
  const TensorInfo& info(const std::string& name) const;
  /// Copies `bytes` bytes of tensor `name`, from byte `offset` of its data, to `dst`.
  /// @throws std::runtime_error naming the file when the range is outside the tensor or the read fails.
  void read(const std::string& name, uint64_t offset, void* dst, uint64_t bytes) const;
  /// Tensor `name` as a new CPU tensor.
  at::Tensor tensor(const std::string& name) const;
  /// The CRC-32 of tensor `name`'s bytes (reads them all).
  uint32_t crc32(const std::string& name) const;

 private:
  std::string path_;
  int fd_ = -1;
  Header header_;
};

/// Every tensor of `path`, by name, as CPU tensors. @throws as Reader.
std::map<std::string, at::Tensor> load_file(const std::string& path);

}  // namespace shardlab::safetensors
