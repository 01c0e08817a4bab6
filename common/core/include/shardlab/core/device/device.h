#pragma once
/// @file device.h
/// Which device a rank computes on: parsing a user's "cpu" / "cuda" / "cuda:N", mapping "cuda" to the GPU of the
/// rank's LOCAL_RANK (the torchrun convention: one process per GPU), and making that GPU current.
///
/// Device-generic (c10's virtual guard): a CPU-only libtorch builds this unchanged and rejects "cuda" with a
/// clear error at run time.

#include <c10/core/Device.h>

#include <string>

namespace shardlab {

/// Parses `name`: "cpu", "cuda" or "cuda:N" (N at most 127: c10 keeps the index in 8 bits).
/// @throws std::invalid_argument naming what was expected and what came.
c10::Device parse_device(const std::string& name);

/// True when this libtorch has CUDA and at least one GPU is visible.
bool cuda_available();

/// Number of visible GPUs (0 without CUDA).
int cuda_device_count();

/// The device rank `local_rank` of this machine should use for `requested`: CPU stays CPU; "cuda" without an
/// index becomes cuda:`local_rank`; "cuda:N" is kept.
/// @throws std::invalid_argument when CUDA is requested but not available, or the index is not a visible GPU.
c10::Device device_for_rank(const c10::Device& requested, int local_rank);

/// Makes `device` the current CUDA device of the calling thread (as `torch.cuda.set_device`); a no-op on CPU.
/// @throws std::invalid_argument for a CUDA device without an index.
void set_current_device(const c10::Device& device);

}  // namespace shardlab
