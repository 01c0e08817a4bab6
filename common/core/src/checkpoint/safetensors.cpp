#include "shardlab/core/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <zlib.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace shardlab::safetensors {

// Note [What a safetensors reader refuses]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The same as Hugging Face's reader (safetensors/src/tensor.rs, `SafeTensors::read_metadata` and
// `Metadata::validate`), so a file this reader accepts is one theirs accepts too:
//  - a file shorter than 8 bytes, a header length past the end of the file or above 100 MB;
//  - a header that is not a JSON object, a "__metadata__" that is not an object of strings, an entry without
//    "dtype", "shape" or "data_offsets", an unknown dtype, a negative size;
//  - data offsets that do not tile the data section: sorted by start, each tensor starts where the one before
//    ended, the first at 0, the last ends where the file ends (a truncated or extended file fails here);
//  - a tensor whose byte count is not its element count times its element size.
// A file written by write_file is laid out as the safetensors library lays it out: the header padded with spaces
// to a multiple of 8 bytes, "__metadata__" first, then the tensors by dtype (highest alignment first) and name,
// each as {"dtype", "shape", "data_offsets"}, and the data in that order, so every tensor's data starts aligned to
// its element size. For the same tensors and at most one metadata key (the library keeps its metadata in a hash
// map, whose order is its own), the file is byte for byte the library's.

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors stores little-endian data");

namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const std::vector<std::pair<c10::ScalarType, const char*>>& names() {
  static const std::vector<std::pair<c10::ScalarType, const char*>> table = {
      {c10::ScalarType::Double, "F64"},    {c10::ScalarType::Float, "F32"}, {c10::ScalarType::Half, "F16"},
      {c10::ScalarType::BFloat16, "BF16"}, {c10::ScalarType::Long, "I64"},  {c10::ScalarType::Int, "I32"},
      {c10::ScalarType::Short, "I16"},     {c10::ScalarType::Char, "I8"},   {c10::ScalarType::Byte, "U8"},
      {c10::ScalarType::Bool, "BOOL"}};
  return table;
}

// Where a dtype sorts in the safetensors library's layout: its Dtype enum lists them by increasing alignment
// (BOOL, U8, I8, I16, F16, BF16, I32, F32, F64, I64), and its writer puts the highest first.
int layout_rank(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Bool:
      return 0;
    case c10::ScalarType::Byte:
      return 1;
    case c10::ScalarType::Char:
      return 2;
    case c10::ScalarType::Short:
      return 5;
    case c10::ScalarType::Half:
      return 7;
    case c10::ScalarType::BFloat16:
      return 8;
    case c10::ScalarType::Int:
      return 9;
    case c10::ScalarType::Float:
      return 11;
    case c10::ScalarType::Double:
      return 12;
    case c10::ScalarType::Long:
      return 13;
    default:
      return -1;  // not written (dtype_name refuses it first)
  }
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("safetensors file '" + path + "': " + what);
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(path, std::string("write failed: ") + std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void read_all(int fd, uint64_t offset, void* data, uint64_t bytes, const std::string& path) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, std::string("read failed: ") + std::strerror(errno));
    if (n == 0) fail(path, "the file ends before byte " + std::to_string(offset + bytes) + " (truncated)");
    p += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
}

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& path, const std::string& name) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) fail(path, "tensor '" + name + "' has a negative size");
    if (s != 0 && n > std::numeric_limits<int64_t>::max() / s) fail(path, "tensor '" + name + "' is too large");
    n *= s;
  }
  return n;
}

Header parse_header(const std::string& path, int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
  Header h;
  h.file_bytes = static_cast<uint64_t>(st.st_size);
  if (h.file_bytes < 8) fail(path, "is " + std::to_string(h.file_bytes) + " bytes, shorter than the 8-byte length");
  uint64_t n = 0;
  read_all(fd, 0, &n, 8, path);
  if (n > kMaxHeaderBytes || n > h.file_bytes - 8)
    fail(path, "its header length " + std::to_string(n) + " exceeds the file (" + std::to_string(h.file_bytes) +
                   " bytes) or 100 MB: not a safetensors file, or truncated");
  std::string text(n, '\0');
  read_all(fd, 8, text.data(), n, path);
  h.data_start = 8 + n;
  if (text.empty() || text.front() != '{') fail(path, "its header does not start with '{' (not a safetensors file)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("its header is not JSON (") + e.what() + ")");
  }
  if (!j.is_object()) fail(path, "its header is not a JSON object");
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> starts;  // (begin, end, name): Hugging Face's order
  try {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) fail(path, "\"__metadata__\" is not an object");
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string()) fail(path, "\"__metadata__\" value of '" + m.key() + "' is not a string");
          h.metadata[m.key()] = m->get<std::string>();
        }
        continue;
      }
      const auto& e = *it;
      if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
        fail(path, "entry '" + it.key() + "' lacks dtype, shape or data_offsets");
      TensorInfo info;
      try {
        info.dtype = dtype_of(e.at("dtype").get<std::string>());
      } catch (const std::invalid_argument& bad) {
        fail(path, "tensor '" + it.key() + "': " + bad.what());
      }
      info.shape = e.at("shape").get<std::vector<int64_t>>();
      const auto offsets = e.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[1] < offsets[0]) fail(path, "tensor '" + it.key() + "' has bad data_offsets");
      info.begin = offsets[0];
      info.end = offsets[1];
      const int64_t numel = checked_numel(info.shape, path, it.key());
      const uint64_t size = c10::elementSize(info.dtype);
      if (static_cast<uint64_t>(numel) > h.file_bytes / size + 1)
        fail(path, "tensor '" + it.key() + "' has more elements than the file has bytes");
      const uint64_t want = static_cast<uint64_t>(numel) * size;
      if (info.end - info.begin != want)
        fail(path, "tensor '" + it.key() + "' has " + std::to_string(info.end - info.begin) + " bytes; its shape and " +
                       dtype_name(info.dtype) + " need " + std::to_string(want));
      starts.emplace_back(info.begin, info.end, it.key());
      h.tensors.emplace(it.key(), std::move(info));
    }
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("its header has a malformed entry (") + e.what() + ")");
  }
  std::sort(starts.begin(), starts.end());
  uint64_t at = 0;
  for (const auto& [begin, end, name] : starts) {
    if (begin != at)
      fail(path, "tensor '" + name + "' starts at byte " + std::to_string(begin) + " of the data, expected " +
                     std::to_string(at) + " (the tensors must tile the data section)");
    at = end;
  }
  if (h.data_start + at != h.file_bytes)
    fail(path, "its tensors end at byte " + std::to_string(h.data_start + at) + " but the file has " +
                   std::to_string(h.file_bytes) + " bytes" +
                   (h.data_start + at > h.file_bytes ? " (truncated)" : " (trailing bytes)"));
  return h;
}

at::Tensor cpu_contiguous(const at::Tensor& t) { return t.device().is_cpu() ? t.contiguous() : t.cpu().contiguous(); }

}  // namespace

std::string dtype_name(c10::ScalarType dtype) {
  for (const auto& [type, name] : names())
    if (type == dtype) return name;
  throw std::invalid_argument(std::string("safetensors has no name for dtype ") + c10::toString(dtype));
}

c10::ScalarType dtype_of(const std::string& name) {
  std::string accepted;
  for (const auto& [type, n] : names()) {
    if (n == name) return type;
    accepted += (accepted.empty() ? "" : ", ") + std::string(n);
  }
  throw std::invalid_argument("unknown safetensors dtype '" + name + "'; expected one of " + accepted);
}

uint32_t crc32(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const Bytef*>(data);
  uLong c = crc;
  while (bytes > 0) {  // zlib's length is a uInt: feed it in pieces below 4 GiB
    const auto n = static_cast<uInt>(std::min<size_t>(bytes, 1U << 30));
    c = ::crc32(c, p, n);
    p += n;
    bytes -= n;
  }
  return static_cast<uint32_t>(c);
}

uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, uint64_t bytes_b) {
  static_assert(sizeof(z_off_t) >= 8, "zlib's offsets must hold a tensor's byte count");
  return static_cast<uint32_t>(::crc32_combine(crc_a, crc_b, static_cast<z_off_t>(bytes_b)));
}

std::vector<size_t> layout_order(const std::vector<TensorSpec>& specs) {
  std::vector<size_t> order(specs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int ra = layout_rank(specs[a].dtype), rb = layout_rank(specs[b].dtype);
    return ra != rb ? ra > rb : specs[a].name < specs[b].name;
  });
  return order;
}

Writer::Writer(const std::string& path, std::vector<TensorSpec> specs,
               const std::map<std::string, std::string>& metadata)
    : path_(path), specs_(std::move(specs)) {
  std::set<std::string> seen;
  for (const TensorSpec& t : specs_) {
    if (t.name.empty() || t.name == "__metadata__" || !seen.insert(t.name).second)
      throw std::invalid_argument("safetensors::Writer('" + path + "'): tensor name '" + t.name +
                                  "' is empty, reserved or repeated");
    dtype_name(t.dtype);  // throws for a dtype the format cannot hold
    for (const int64_t size : t.shape)
      if (size < 0)
        throw std::invalid_argument("safetensors::Writer('" + path + "'): '" + t.name + "' has a negative size");
  }
  order_ = layout_order(specs_);
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t at = 0;
  for (const size_t i : order_) {
    const TensorSpec& t = specs_[i];
    const uint64_t bytes = static_cast<uint64_t>(checked_numel(t.shape, path, t.name)) * c10::elementSize(t.dtype);
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path, std::string("cannot create: ") + std::strerror(errno));
  try {
    const uint64_t n = text.size();
    write_all(fd_, &n, 8, path);
    write_all(fd_, text.data(), text.size(), path);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
}

size_t Writer::next() const {
  if (written_ == order_.size())
    throw std::logic_error("safetensors::Writer('" + path_ + "'): every tensor was written already");
  return order_[written_];
}

uint32_t Writer::write(const at::Tensor& tensor) {
  if (failed_) throw std::logic_error("safetensors::Writer('" + path_ + "'): an earlier write failed");
  const TensorSpec& t = specs_[next()];
  if (fd_ < 0) throw std::logic_error("safetensors::Writer('" + path_ + "'): the file is closed");
  if (!tensor.defined() || tensor.scalar_type() != t.dtype || tensor.sizes().vec() != t.shape)
    throw std::invalid_argument("safetensors::Writer('" + path_ + "'): '" + t.name + "' is declared " +
                                dtype_name(t.dtype) + " " + c10::str(c10::IntArrayRef(t.shape)) + "; got " +
                                (tensor.defined()
                                     ? std::string(c10::toString(tensor.scalar_type())) + " " + c10::str(tensor.sizes())
                                     : "an undefined tensor"));
  const at::Tensor c = cpu_contiguous(tensor);
  const size_t bytes = static_cast<size_t>(c.numel()) * c.element_size();
  try {
    write_all(fd_, c.data_ptr(), bytes, path_);
  } catch (...) {  // part of it may be in the file: nothing after it may be
    failed_ = true;
    throw;
  }
  ++written_;
  return crc32(c.data_ptr(), bytes);
}

void Writer::finish() {
  if (failed_) throw std::logic_error("safetensors::Writer('" + path_ + "'): an earlier write failed");
  if (written_ != order_.size())
    throw std::logic_error("safetensors::Writer('" + path_ + "'): finished after " + std::to_string(written_) + " of " +
                           std::to_string(order_.size()) + " tensors");
  if (fd_ < 0) throw std::logic_error("safetensors::Writer('" + path_ + "'): finished twice");
  const int fd = std::exchange(fd_, -1);
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail(path_, std::string("fsync failed: ") + std::strerror(errno));
  }
  if (::close(fd) != 0) fail(path_, std::string("close failed: ") + std::strerror(errno));
}

std::vector<uint32_t> write_file(const std::string& path,
                                 const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      throw std::invalid_argument("safetensors::write_file('" + path + "'): '" + name + "' is undefined");
    specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  Writer writer(path, std::move(specs), metadata);
  std::vector<uint32_t> crcs(tensors.size());
  for (const size_t i : writer.order()) crcs[i] = writer.write(tensors[i].second);
  writer.finish();
  return crcs;
}

Reader::Reader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  try {
    header_ = parse_header(path, fd_);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

Reader::~Reader() {
  if (fd_ >= 0) ::close(fd_);
}

Reader::Reader(Reader&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), header_(std::move(other.header_)) {}

Reader& Reader::operator=(Reader&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    header_ = std::move(other.header_);
  }
  return *this;
}

const TensorInfo& Reader::info(const std::string& name) const {
  const auto it = header_.tensors.find(name);
  if (it == header_.tensors.end()) fail(path_, "has no tensor '" + name + "'");
  return it->second;
}

void Reader::read(const std::string& name, uint64_t offset, void* dst, uint64_t bytes) const {
  const TensorInfo& i = info(name);
  if (offset > i.end - i.begin || bytes > i.end - i.begin - offset)
    fail(path_, "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) + ") are outside tensor '" +
                    name + "' (" + std::to_string(i.end - i.begin) + " bytes)");
  read_all(fd_, header_.data_start + i.begin + offset, dst, bytes, path_);
}

at::Tensor Reader::tensor(const std::string& name) const {
  const TensorInfo& i = info(name);
  at::Tensor t = at::empty(i.shape, at::TensorOptions().dtype(i.dtype));
  read(name, 0, t.data_ptr(), i.end - i.begin);
  return t;
}

uint32_t Reader::crc32(const std::string& name) const {
  const TensorInfo& i = info(name);
  std::vector<char> buffer(std::min<uint64_t>(i.end - i.begin, 1U << 24));
  uint32_t crc = 0;
  for (uint64_t at = 0; at < i.end - i.begin; at += buffer.size()) {
    const uint64_t n = std::min<uint64_t>(buffer.size(), i.end - i.begin - at);
    read(name, at, buffer.data(), n);
    crc = safetensors::crc32(buffer.data(), n, crc);
  }
  return crc;
}

std::map<std::string, at::Tensor> load_file(const std::string& path) {
  const Reader reader(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, info] : reader.header().tensors) out.emplace(name, reader.tensor(name));
  return out;
}

}  // namespace shardlab::safetensors
