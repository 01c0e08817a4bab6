#include "shardlab/course/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <set>
#include <stdexcept>

namespace shardlab {
namespace {

// Mixes (seed, stream, step) into one generator seed (splitmix64 finalizer).
uint64_t mix(uint64_t seed, uint64_t stream, int64_t step) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + stream * 0xBF58476D1CE4E5B9ULL + static_cast<uint64_t>(step) + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

at::Generator generator(uint64_t seed, uint64_t stream, int64_t step) {
  return at::make_generator<at::CPUGeneratorImpl>(mix(seed, stream, step));
}

void check_batch_size(int64_t batch_size) {
  if (batch_size < 1) throw std::invalid_argument("batch size must be >= 1; got " + std::to_string(batch_size));
}

}  // namespace

SyntheticDataset::SyntheticDataset(int64_t features, int64_t classes, uint64_t seed)
    : features_(features), classes_(classes), seed_(seed) {
  teacher_ = at::randn({features, classes}, generator(seed, /*stream=*/1, 0), at::kFloat);
}

Batch SyntheticDataset::global_batch(int64_t step, int64_t batch_size) const {
  check_batch_size(batch_size);
  at::Tensor x = at::randn({batch_size, features_}, generator(seed_, /*stream=*/2, step), at::kFloat);
  at::Tensor y = at::matmul(x, teacher_).argmax(1);
  return Batch{x, y, step};
}

TextDataset::TextDataset(int64_t block, uint64_t seed) : block_(block), seed_(seed) {
  const std::string& text = tiny_corpus();
  const std::string& vocab = corpus_vocab();
  std::vector<int64_t> ids(text.size());
  std::transform(text.begin(), text.end(), ids.begin(), [&](char c) { return static_cast<int64_t>(vocab.find(c)); });
  tokens_ = at::tensor(ids, at::kLong);
  if (tokens_.numel() <= block_ + 1)
    throw std::invalid_argument("TextDataset: corpus of " + std::to_string(tokens_.numel()) +
                                " characters is too short for block " + std::to_string(block_));
}

Batch TextDataset::global_batch(int64_t step, int64_t batch_size) const {
  check_batch_size(batch_size);
  at::Tensor starts =
      at::randint(tokens_.numel() - block_ - 1, {batch_size}, generator(seed_, /*stream=*/3, step), at::kLong);
  at::Tensor offsets = at::arange(block_, at::kLong);
  at::Tensor index = starts.unsqueeze(1) + offsets.unsqueeze(0);  // [B, T]
  return Batch{tokens_.index_select(0, index.reshape({-1})).reshape({batch_size, block_}),
               tokens_.index_select(0, (index + 1).reshape({-1})).reshape({batch_size, block_}), step};
}

const std::string& corpus_vocab() {
  static const std::string vocab = [] {
    const std::string& text = tiny_corpus();
    std::set<char> chars(text.begin(), text.end());
    return std::string(chars.begin(), chars.end());
  }();
  return vocab;
}

std::unique_ptr<Dataset> make_dataset(const std::string& name, uint64_t seed) {
  if (name == "mlp") return std::make_unique<SyntheticDataset>(16, 4, seed);
  if (name == "edge") return std::make_unique<SyntheticDataset>(8, 3, seed);
  if (name == "tiny_gpt") return std::make_unique<TextDataset>(32, seed);
  throw std::invalid_argument("no dataset for model '" + name + "'; expected one of: mlp, tiny_gpt, edge");
}

Batch rank_slice(const Batch& global, int rank, int world_size) {
  const int64_t B = global.size();
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("rank_slice: expected 0 <= rank < world_size; got rank " + std::to_string(rank) +
                                ", world_size " + std::to_string(world_size));
  if (B % world_size != 0)
    throw std::invalid_argument("global batch " + std::to_string(B) + " does not divide by world size " +
                                std::to_string(world_size) + "; choose a global batch that is a multiple of it");
  const int64_t per_rank = B / world_size;
  return global.slice(rank * per_rank, per_rank);
}

std::vector<Batch> micro_batches(const Batch& batch, int count) {
  if (count < 1 || batch.size() % count != 0)
    throw std::invalid_argument("batch of " + std::to_string(batch.size()) + " examples does not split into " +
                                std::to_string(count) + " equal micro-batches");
  const int64_t each = batch.size() / count;
  std::vector<Batch> out;
  out.reserve(count);
  for (int i = 0; i < count; ++i) out.push_back(batch.slice(i * each, each));
  return out;
}

}  // namespace shardlab
