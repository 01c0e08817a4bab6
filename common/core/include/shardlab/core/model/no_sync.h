#pragma once
/// @file no_sync.h
/// The gradient-accumulation scope that every data-parallel wrapper hands out from its `no_sync()` (PyTorch DDP's
/// `no_sync()` context; FSDP2's `set_requires_gradient_sync(false)`).

namespace shardlab {

/// RAII scope that turns a wrapper's gradient synchronization off; the previous setting returns when it ends, so
/// scopes nest. Backward passes inside it accumulate local gradients; the first one outside reduces the sum.
class NoSync {
 public:
  /// Sets `sync_enabled` to false until destruction. `sync_enabled` must outlive the scope.
  explicit NoSync(bool& sync_enabled);
  /// Restores the previous setting.
  ~NoSync();
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;

 private:
  bool& sync_enabled_;
  bool previous_;
};

}  // namespace shardlab
