#include "shardlab/core/model/model_check.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace shardlab {

// Note [Comparing the ranks' models]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What must agree is what the wrappers size and pair their collectives with: the units, and every parameter's and
// buffer's name, sizes, dtype, device type and requires_grad, in registration order (broadcasts and buckets follow
// it). Values need not agree: the broadcast that follows makes them rank 0's.
//
// The check is one collective in the common case. Each rank all-gathers a fixed-size digest of its structure (its
// entry count, its length in bytes and a 64-bit FNV-1a hash of its text): the same size on every rank, so even
// ranks that disagree pair it safely. Only when a digest differs from rank 0's do the ranks all-gather their whole
// texts, padded to the longest length the digests gave (again one size everywhere), and every rank computes the same
// message: the first entry that differs, the ranks that differ, both values. Every rank throws it, so no rank goes
// on to a training collective that another never issues.
//
// Compared against rank 0 because rank 0's values are the ones the broadcast then gives everyone, as DDP does. A
// 64-bit hash can collide; two different structures that collide (probability 2^-64 per pair) pass as one, which is
// the bargain PyTorch's DDP makes too (it compares shapes through an all-gather of their sizes, not names).

namespace {

constexpr int64_t kDigestWords = 4;  // version, entries, bytes, hash
constexpr int64_t kVersion = 1;

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  return text;
}

int64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (const unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  int64_t out = 0;
  std::memcpy(&out, &h, sizeof(out));
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t from = 0;
  while (from < text.size()) {
    const size_t end = text.find('\n', from);
    if (end == std::string::npos) break;
    out.push_back(text.substr(from, end - from));
    from = end + 1;
  }
  return out;
}

// The tensors the check moves travel on the group's device: CPU on Gloo; on NCCL the parameters' CUDA device, or
// the current CUDA device when this rank's model has none (its structure then says "cpu" and differs: the check
// must still run, so that every rank hears of it, rather than this rank throwing alone).
c10::Device check_device(const Model& model, const Communicator& comm) {
  if (comm.kind() != BackendKind::kNccl) return c10::Device(c10::kCPU);
  for (const auto& p : model.parameters(/*recurse=*/true))
    if (p.is_cuda()) return p.device();
  for (const auto& b : model.buffers(/*recurse=*/true))
    if (b.is_cuda()) return b.device();
  return c10::impl::VirtualGuardImpl(c10::kCUDA).getDevice();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

// The message every rank throws: the first entry (lowest position, then lowest rank) where a rank's structure
// differs from rank 0's.
std::string describe_difference(const std::vector<std::vector<std::string>>& all) {
  const auto& zero = all[0];
  size_t first = SIZE_MAX;
  int first_rank = -1;
  std::vector<int> differing;
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == zero) continue;
    differing.push_back(static_cast<int>(r));
    size_t k = 0;
    while (k < zero.size() && k < all[r].size() && zero[k] == all[r][k]) ++k;
    if (k < first) {
      first = k;
      first_rank = static_cast<int>(r);
    }
  }
  const auto& other = all[first_rank];
  auto at = [](const std::vector<std::string>& v, size_t k) {
    return k < v.size() ? v[k]
                        : std::string("nothing (its structure ends after ") + std::to_string(v.size()) + " entries)";
  };
  std::string msg = "the ranks' models differ at entry " + std::to_string(first) + " of their structure: rank " +
                    std::to_string(first_rank) + " has " + at(other, first) + "; rank 0 has " + at(zero, first) + ".";
  msg += " Ranks that differ from rank 0: " + rank_list(differing) + ".";
  return msg;
}

}  // namespace

std::vector<std::string> model_structure(const Model& model) {
  // One entry per line of the text the check compares: a name holding a line break keeps it, escaped.
  auto quoted = [](const std::string& name) {
    std::string q = "'";
    for (const char c : name) q += c == '\n' ? std::string("\\n") : std::string(1, c);
    return q + "'";
  };
  std::vector<std::string> out;
  for (size_t u = 0; u < model.units().size(); ++u)
    out.push_back("unit " + std::to_string(u) + " " + quoted(model.units()[u].name));
  auto describe = [&](const char* kind, const std::string& name, const at::Tensor& t, bool with_grad) {
    std::string s = std::string(kind) + " " + quoted(name) + ": ";
    if (!t.defined()) return s + "undefined";
    s += "sizes " + c10::str(t.sizes()) + ", " + std::string(c10::toString(t.scalar_type())) + ", " +
         c10::DeviceTypeName(t.device().type(), /*lower_case=*/true);
    if (with_grad) s += t.requires_grad() ? ", requires_grad" : ", frozen";
    return s;
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    out.push_back(describe("parameter", item.key(), item.value(), true));
  for (const auto& item : model.named_buffers(/*recurse=*/true))
    out.push_back(describe("buffer", item.key(), item.value(), false));
  return out;
}

void check_same_model(const Model& model, Communicator& comm, const std::string& who) {
  if (comm.size() == 1) return;
  const std::vector<std::string> lines = model_structure(model);
  const std::string text = joined(lines);
  const c10::Device device = check_device(model, comm);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor mine = at::tensor(std::vector<int64_t>{kVersion, static_cast<int64_t>(lines.size()),
                                                    static_cast<int64_t>(text.size()), fnv1a(text)},
                               i64);
  mine = mine.to(device);
  at::Tensor digests = at::empty({comm.size() * kDigestWords}, i64.device(device));
  auto gather = [&](const at::Tensor& out, const at::Tensor& in, const char* what) {
    try {
      comm.all_gather(out, in).wait();
    } catch (const std::exception& e) {
      throw std::runtime_error(who + ": rank " + std::to_string(comm.rank()) + " of group '" + comm.name() +
                               "' could not compare its model with the other ranks' (" + what +
                               "): every rank must construct the wrapper at the same point (a rank that never "
                               "arrives fails the others after the group's timeout). " +
                               e.what());
    }
  };
  gather(digests, mine, "the all-gather of the structure digests");
  const at::Tensor d = digests.cpu().view({comm.size(), kDigestWords});
  bool same = true;
  for (int r = 1; r < comm.size(); ++r) same = same && d[r].equal(d[0]);
  if (same) return;
  // Some rank differs: bring every rank's text (padded to the longest) so every rank names the same difference.
  const int64_t longest = d.select(1, 2).max().item<int64_t>();
  at::Tensor padded = at::zeros({longest}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(padded.data_ptr<uint8_t>(), text.data(), text.size());
  at::Tensor texts = at::empty({comm.size() * longest}, padded.options().device(device));
  gather(texts, padded.to(device), "the all-gather of the structures that differ");
  const at::Tensor all = texts.cpu();
  std::vector<std::vector<std::string>> structures;
  for (int r = 0; r < comm.size(); ++r) {
    const int64_t bytes = d[r][2].item<int64_t>();
    const auto* base = all.data_ptr<uint8_t>() + r * longest;
    structures.push_back(split_lines(std::string(reinterpret_cast<const char*>(base), static_cast<size_t>(bytes))));
  }
  if (std::all_of(structures.begin() + 1, structures.end(), [&](const auto& s) { return s == structures[0]; }))
    throw std::invalid_argument(who +
                                ": the ranks' model digests differ but their structures are equal: ranks "
                                "run different shardlab builds (digest version or hash differs)");
  throw std::invalid_argument(who + ": " + describe_difference(structures) +
                              " Every rank must build the same model (names, sizes, dtypes, devices, requires_grad, "
                              "buffers and units, in the same order); its values may differ, rank 0's are broadcast.");
}

}  // namespace shardlab
