#pragma once
/// @file no_sync.h
/// Stage 01 — the gradient-accumulation scope every data-parallel wrapper of the course hands out.
///
/// A header of its own (defined in naive_ddp.cpp) so that later stages include it without naive_ddp.h, whose
/// private state is the student's (see Note [A starter's headers] in cmake/ShardLabStage.cmake).

namespace shardlab::naive_ddp {

/// RAII scope that turns a DDP wrapper's gradient synchronization off; the previous setting returns when it ends.
/// Every DDP wrapper of the course hands one out from its `no_sync()`.
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

}  // namespace shardlab::naive_ddp
