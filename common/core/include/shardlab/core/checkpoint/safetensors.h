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

/// The CRC-32 of the bytes of A followed by the bytes of B, from `crc_a`, `crc_b` and B's length (zlib's
/// crc32_combine): a whole tensor's CRC-32 from its pieces', without their bytes.
uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t bytes_b);

/// One tensor of a file to write, as its header will describe it.
struct TensorSpec {
  std::string name;                                ///< its name in the file
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< its element type
  std::vector<int64_t> shape;                      ///< its sizes; empty for a 0-dim tensor
};

/// The order the safetensors library lays `specs` out in, as indices into `specs`: by dtype, highest alignment
/// first (I64, F64, F32, I32, BF16, F16, I16, I8, U8, BOOL: the library's Dtype order, reversed), then by name.
std::vector<size_t> layout_order(const std::vector<TensorSpec>& specs);

/// A safetensors file written one tensor at a time, so that a writer holds one tensor, never the file's content
/// (a full checkpoint gathered tensor by tensor, an export read piece by piece). The header, with every tensor's
/// place, is written first; then each tensor, in order(). Write to a staging path and rename it once finish()
/// returned: a writer destroyed before leaves a partial file. Not copyable.
class Writer {
 public:
  /// Creates `path` (replacing a file there) and writes the header for `specs` and `metadata`, laid out as
  /// write_file lays them out.
  /// @throws std::invalid_argument for an empty, reserved or repeated name, a dtype the format cannot hold or a
  ///         negative size, before the file is created; std::runtime_error naming the file when it cannot be
  ///         created or written.
  Writer(const std::string& path, std::vector<TensorSpec> specs, const std::map<std::string, std::string>& metadata);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  /// The order the tensors are written in (indices into the specs given).
  const std::vector<size_t>& order() const { return order_; }
  /// The index (into the specs given) of the tensor the next write() takes.
  /// @throws std::logic_error when every tensor was written.
  size_t next() const;
  /// Writes `tensor` (any device, any strides) as the next tensor of order(); returns the CRC-32 of its bytes.
  /// @throws std::invalid_argument when its dtype or sizes are not the spec's; std::runtime_error naming the file
  ///         when the write fails (the writer is then failed: every later call throws); std::logic_error when every
  ///         tensor was written or the writer failed.
  uint32_t write(const at::Tensor& tensor);
  /// Flushes the file to the disk (fsync) and closes it.
  /// @throws std::logic_error when a tensor was not written; std::runtime_error naming the file on a failure.
  void finish();

 private:
  std::string path_;
  std::vector<TensorSpec> specs_;
  std::vector<size_t> order_;
  size_t written_ = 0;
  int fd_ = -1;
  bool failed_ = false;  // a write failed part-way: the file is not whole, and nothing more is written
};

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
