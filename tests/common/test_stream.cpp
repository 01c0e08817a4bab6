// Tests of the stream/event wrapper: every call is a harmless no-op on CPU (where c10 would throw), and on CUDA
// (only when a GPU is present) a side stream is really ordered by an event.
#include "shardlab/core/device/stream.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <iostream>

namespace shardlab {
namespace {

TEST(Stream, CpuStreamsAndEventsAreNoOps) {
  const c10::Device cpu(c10::kCPU);
  Stream current = Stream::current(cpu);
  Stream side = Stream::side(cpu, /*high_priority=*/true);
  EXPECT_TRUE(current.is_noop());
  EXPECT_EQ(current, side) << "CPU has one stream: the side stream is the current one";
  EXPECT_EQ(current.device(), cpu);

  Event event(cpu);
  EXPECT_NO_THROW(event.record(side)) << "c10::Event::record would throw on CPU";
  EXPECT_FALSE(event.recorded()) << "nothing is recorded on CPU";
  EXPECT_TRUE(event.query());
  EXPECT_NO_THROW(current.wait(event));
  EXPECT_NO_THROW(current.wait(side));
  EXPECT_NO_THROW(side.synchronize());

  at::Tensor t = at::ones({4});
  {
    StreamGuard guard(side);
    t.add_(1);  // runs at once, in program order
    EXPECT_NO_THROW(record_stream(t, side));
  }
  EXPECT_EQ(Stream::current(cpu), current);
  EXPECT_EQ(t.sum().item<float>(), 8.0f);
  EXPECT_NO_THROW(record_stream(at::Tensor(), side)) << "undefined tensors are ignored";
}

// Work on a side stream, published to the current stream through an event: the current stream must see the side
// stream's result. Without the wait, the read could run before the (long) side-stream work has finished.
TEST(Stream, NeedsAGpuCudaSideStreamIsOrderedByEvent) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the CPU no-op path is covered above";
  const c10::Device gpu(c10::kCUDA, 0);
  Stream current = Stream::current(gpu);
  Stream side = Stream::side(gpu);
  EXPECT_FALSE(current.is_noop());
  EXPECT_NE(current, side) << "a pool stream must differ from the current (default) stream";

  // a = 1/n everywhere, so ones @ a = ones: the result stays all ones however many products run.
  constexpr int64_t n = 2048;
  at::Tensor a = at::full({n, n}, 1.0f / n, at::TensorOptions().device(gpu));
  at::Tensor result;
  Event done(gpu);
  {
    StreamGuard guard(side);
    EXPECT_EQ(Stream::current(gpu), side) << "the guard makes the side stream current";
    side.wait(current);  // `a` was filled on the current stream
    result = at::ones({n, n}, a.options());
    for (int i = 0; i < 20; ++i) result = at::matmul(result, a);  // long enough to be still running below
    done.record(side);
    record_stream(result, current);  // made on `side`, read on `current` below
  }
  EXPECT_EQ(Stream::current(gpu), current) << "the guard restores the previous stream";
  EXPECT_TRUE(done.recorded());
  Event moved = std::move(done);
  EXPECT_TRUE(moved.recorded()) << "a moved event keeps its recorded point";
  current.wait(moved);
  const double sum = result.sum().item<double>();  // issued on the current stream, after the wait
  const double expected = static_cast<double>(n) * n;
  std::cout << "  side-stream result sum " << sum << " (expected " << expected << ")\n";
  EXPECT_NEAR(sum, expected, expected * 1e-4);
  side.synchronize();
  EXPECT_TRUE(moved.query());
}

}  // namespace
}  // namespace shardlab
