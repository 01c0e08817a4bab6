#pragma once
/// @file data.h
/// Deterministic data: every rank can build the same global batch for any step, and take its own slice.

#include "shardlab/course/model_factory.h"

#include <memory>
#include <string>
#include <vector>

namespace shardlab {

/// A source of global batches, deterministic in (seed, step).
class Dataset {
 public:
  virtual ~Dataset() = default;
  /// The global batch of `batch_size` examples for `step`.
  virtual Batch global_batch(int64_t step, int64_t batch_size) const = 0;
};

/// Synthetic classification: features ~ N(0, 1), labels from a fixed random linear teacher.
class SyntheticDataset : public Dataset {
 public:
  /// @param features input width; @param classes number of labels; @param seed fixes the teacher and the inputs.
  SyntheticDataset(int64_t features, int64_t classes, uint64_t seed);
  /// See Dataset::global_batch.
  Batch global_batch(int64_t step, int64_t batch_size) const override;

 private:
  int64_t features_, classes_;
  uint64_t seed_;
  at::Tensor teacher_;  // [features, classes]
};

/// Windows of `block` characters from the shipped public-domain corpus; the target is the input shifted by one.
class TextDataset : public Dataset {
 public:
  /// @param block context length T; @param seed picks the window offsets.
  TextDataset(int64_t block, uint64_t seed);
  /// See Dataset::global_batch.
  Batch global_batch(int64_t step, int64_t batch_size) const override;

 private:
  int64_t block_;
  uint64_t seed_;
  at::Tensor tokens_;  // [corpus length] int64
};

/// The shipped corpus (public-domain text), compiled into the library.
const std::string& tiny_corpus();
/// The sorted distinct characters of tiny_corpus(); token id = index in this string.
const std::string& corpus_vocab();

/// The dataset that matches model `name` (see make_model).
std::unique_ptr<Dataset> make_dataset(const std::string& name, uint64_t seed);

/// Rank `rank`'s contiguous slice of `global`: examples [rank*B/W, (rank+1)*B/W).
/// @throws std::invalid_argument when B does not divide by `world_size`, naming both.
Batch rank_slice(const Batch& global, int rank, int world_size);

/// Splits `batch` into `count` equal micro-batches.
/// @throws std::invalid_argument when the batch size does not divide by `count`.
std::vector<Batch> micro_batches(const Batch& batch, int count);

}  // namespace shardlab
