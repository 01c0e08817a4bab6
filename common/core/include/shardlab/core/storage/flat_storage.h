#pragma once
/// @file flat_storage.h
/// Tensors that live in one flat buffer, and storage that can be freed and regrown in place.
///
/// Vocabulary:
///  - *slot*: a tensor that uses `numel(sizes)` elements of a flat buffer's storage from an offset, shaped like a
///    parameter. It is made with `set_`, so it shares the storage without being an autograd *view* of the
///    buffer: autograd lets it be a leaf, `.grad()`, and detached in place (`zero_grad` does), which a view
///    cannot. Stage 02's gradient buckets and stage 04's gathered parameters are slots.
///  - *free / regrow*: the storage keeps its identity (the same StorageImpl, so every tensor on it, autograd's
///    saved tensors included, still points to it) while its bytes go to 0 and come back. See
///    Note [Freeing storage that autograd saved] in flat_storage.cpp.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace shardlab {

/// A slot of `flat`: `numel(sizes)` elements from element `offset` of `flat` (counted from `flat`'s own start),
/// contiguous, shaped `sizes`, same dtype and device. Writing to one writes to the other.
/// @pre flat is contiguous and `offset + numel(sizes) <= flat.numel()`.
/// @throws std::invalid_argument naming the sizes and the buffer when the slot does not fit.
at::Tensor alias_slot(const at::Tensor& flat, int64_t offset, c10::IntArrayRef sizes);

/// Bytes the storage of `t` holds now (0 once freed, or for an undefined tensor).
int64_t storage_bytes(const at::Tensor& t);

/// Gives the storage of `t` 0 bytes, so its memory is returned even while other tensors (slots, autograd's saved
/// tensors) still point to the storage. A no-op on an undefined tensor or a storage already at 0 bytes.
void free_storage(const at::Tensor& t);

/// Gives the storage of `t` `nbytes` fresh (uninitialized) bytes from its own allocator, keeping the storage
/// object, so every tensor on it sees the new memory. Refill it through a tensor that is *not* one autograd
/// saved (see Note [Freeing storage that autograd saved]).
/// @pre the storage is freed (0 bytes); `nbytes` >= 0.
/// @throws std::logic_error when the storage still holds bytes (regrowing would leak or alias them).
void regrow_storage(const at::Tensor& t, int64_t nbytes);

}  // namespace shardlab
