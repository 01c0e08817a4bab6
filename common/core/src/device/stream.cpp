#include "shardlab/core/device/stream.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <stdexcept>
#include <string>

namespace shardlab {
namespace {

bool is_cpu(c10::DeviceType type) { return type == c10::DeviceType::CPU; }

}  // namespace

Stream Stream::current(c10::Device device) {
  if (device.is_cpu()) return Stream(c10::Stream(c10::Stream::DEFAULT, device));
  c10::impl::VirtualGuardImpl impl(device.type());
  // A device without an index means "the current one", as in torch.
  if (!device.has_index()) device = impl.getDevice();
  return Stream(impl.getStream(device));
}

Stream Stream::side(c10::Device device, bool high_priority) {
  if (device.is_cpu()) return current(device);
  c10::impl::VirtualGuardImpl impl(device.type());
  if (!device.has_index()) device = impl.getDevice();
  return Stream(impl.getStreamFromGlobalPool(device, high_priority));
}

void Stream::wait(const Event& event) const {
  if (is_noop() || !event.recorded()) return;
  if (event.type_ != stream_.device_type())
    throw std::invalid_argument(std::string("Stream::wait: the event is for ") + c10::DeviceTypeName(event.type_) +
                                " streams; this stream is on " + stream_.device().str());
  event.event_->block(stream_);
}

void Stream::wait(const Stream& other) const {
  if (is_noop() || other.is_noop() || other == *this) return;
  Event e(other.device());
  e.record(other);
  wait(e);
}

void Stream::synchronize() const {
  if (is_noop()) return;
  c10::impl::VirtualGuardImpl(stream_.device_type()).synchronizeStream(stream_);
}

Event::Event(c10::Device device) : type_(device.type()) {
  if (!is_cpu(type_)) event_.emplace(type_);
}

void Event::record(const Stream& stream) {
  if (stream.device().type() != type_)
    throw std::invalid_argument(std::string("Event::record: the event is for ") + c10::DeviceTypeName(type_) +
                                " streams; got a stream on " + stream.device().str());
  if (event_) event_->record(stream.raw());
}

bool Event::query() const { return !event_ || event_->query(); }

StreamGuard::StreamGuard(const Stream& stream) {
  if (!stream.is_noop()) guard_.reset_stream(stream.raw());
}

void record_stream(const at::Tensor& t, const Stream& stream) {
  if (!t.defined() || stream.is_noop() || t.device().is_cpu()) return;
  if (t.device() != stream.device())
    throw std::invalid_argument("record_stream: the tensor is on " + t.device().str() + ", the stream on " +
                                stream.device().str() + "; expected the same device");
  c10::impl::VirtualGuardImpl(stream.device().type()).recordDataPtrOnStream(t.storage().data_ptr(), stream.raw());
}

}  // namespace shardlab
