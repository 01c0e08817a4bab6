#include "shardlab/core/storage/flat_storage.h"

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/strides.h>

#include <stdexcept>
#include <string>

// Note [Freeing storage that autograd saved]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// FSDP frees a unit's gathered parameters after its forward and gathers them again before its backward. Autograd
// saved some of those tensors in the forward (a Linear saves its weight to compute the input's gradient), so the
// memory must go while the *tensors* stay valid, and come back holding the same values before backward reads them.
//  - Free: the StorageImpl's data pointer is swapped for an empty one (0 bytes). Every tensor that points to the
//    storage (the parameter, its slots, autograd's SavedVariables) keeps pointing to the same StorageImpl.
//  - Regrow: fresh bytes from the storage's own allocator (CPU or the CUDA caching allocator) go into the same
//    StorageImpl; nothing about any tensor on it changes.
//  - Refill: autograd checks, when backward unpacks a saved tensor, that its *version counter* has not moved
//    since the forward saved it. An in-place write through the parameter itself (`param.copy_(...)`) bumps that
//    counter, and backward fails with "modified by an inplace operation" (PyTorch FSDP2 on CPU in torch 2.6 fails
//    exactly so). A write through another tensor on the same storage that is not a view of the parameter (the
//    flat buffer, of which the parameter is a slot: see alias_slot) bumps only that tensor's own counter. So the
//    all-gather and the copy-out write through the flat buffers, and the parameter's counter never moves.
// Checked on libtorch 1.13 and 2.6 (../shared/LIBTORCH-NOTES.md): gradients equal an unsharded run exactly.

namespace shardlab {

at::Tensor alias_slot(const at::Tensor& flat, int64_t offset, c10::IntArrayRef sizes) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  if (!flat.is_contiguous() || offset < 0 || offset + numel > flat.numel())
    throw std::invalid_argument("alias_slot: a slot of sizes " + c10::str(sizes) + " at element " +
                                std::to_string(offset) + " does not fit a contiguous buffer of " +
                                std::to_string(flat.numel()) + " elements");
  at::Tensor slot = at::empty({0}, flat.options());
  slot.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return slot;
}

int64_t storage_bytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0; }

void free_storage(const at::Tensor& t) {
  if (!t.defined()) return;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() == 0) return;
  at::Allocator* alloc = impl->allocator();
  impl->set_data_ptr_noswap(alloc ? alloc->allocate(0) : at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void regrow_storage(const at::Tensor& t, int64_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (impl->nbytes() != 0)
    throw std::logic_error("regrow_storage: the storage still holds " + std::to_string(impl->nbytes()) +
                           " bytes; free it first");
  if (nbytes < 0) throw std::invalid_argument("regrow_storage: expected nbytes >= 0; got " + std::to_string(nbytes));
  at::Allocator* alloc = impl->allocator();
  if (alloc == nullptr) throw std::logic_error("regrow_storage: the storage has no allocator to regrow from");
  impl->set_data_ptr_noswap(alloc->allocate(static_cast<size_t>(nbytes)));
  impl->set_nbytes(static_cast<size_t>(nbytes));
}

}  // namespace shardlab
