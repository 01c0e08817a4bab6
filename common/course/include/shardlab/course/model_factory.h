#pragma once
/// @file model_factory.h
/// The models every stage trains, by name (part of shardlab::course, the course library, not of shardlab::core).
/// All are deterministic from a seed: the same seed gives bit-identical parameters on every rank and every run,
/// without touching the global RNG (ranks may be threads).

#include "shardlab/core/model/model.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardlab {

/// Names accepted by make_model: "mlp", "tiny_gpt", "edge".
const std::vector<std::string>& model_names();

/// True when model `name` leaves a trainable parameter without a gradient in some steps ("edge": on odd steps), so
/// that a wrapper must be told to allow it (DDP's find_unused_parameters, FSDP's allow_unused_parameters).
/// @throws std::invalid_argument naming the accepted models if `name` is unknown.
bool leaves_parameters_unused(const std::string& name);

/// Transformer blocks of "tiny_gpt" when nothing else is asked for (each block is one unit).
constexpr int64_t kDefaultGptLayers = 4;

/// Width of "tiny_gpt" when nothing else is asked for.
constexpr int64_t kDefaultGptDim = 32;

/// Builds "tiny_gpt" with `layers` blocks (>= 1) of width `dim` (even: 2 heads) from `seed`, on `device`
/// (initialized on CPU, then moved).
/// @throws std::invalid_argument when layers < 1 or dim is not a positive multiple of 2.
std::shared_ptr<Model> make_tiny_gpt(int64_t layers, uint64_t seed, const c10::Device& device,
                                     int64_t dim = kDefaultGptDim);

/// Builds model `name` with parameters drawn from `seed`.
/// @throws std::invalid_argument naming the accepted models if `name` is unknown.
std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed);

/// Model `name` from `seed`, initialized on CPU (so every device starts from bit-identical values) and then moved
/// to `device`. @throws std::invalid_argument as make_model(name, seed).
std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed, const c10::Device& device);

}  // namespace shardlab
