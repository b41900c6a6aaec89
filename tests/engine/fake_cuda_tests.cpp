// The fake CUDA driver (fake_cuda.h) behind cuda::DriverOverride: streams run in order and
// block on their waits, events reach as their records run, failures come back as the engine's
// errors; then the copy engines' receiver side (a copy out of a slot, CopyEngineContext) run
// in-process on it: bytes land and words are written only once what they wait for is set.

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/CudaOps.h"
#include "engine/GroupState.h"
#include "engine/ProgressThread.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/Stream.h"
#include "engine/cuda/StreamMemoryOps.h"

#include "check.h"
#include "fake_cuda.h"
#include "test_copy_engine_op.h"

using namespace smfree::engine;
using testing::throwsError;
using testing::FakeCuda;
using testing::TestCopyEngineOp;

namespace {

cuda::Place host(const void* pointer) { return cuda::Place::of(pointer, 0); }

TEST(fakeStreamWaitsForItsWord, "fake cuda: a copy queued behind a word wait runs once it is set") {
  FakeCuda fake;
  cuda::Stream stream(0, cuda::Stream::OnDestroy::kRelease);
  alignas(4) uint32_t ready = 0;
  alignas(4) uint32_t done = 0;
  const std::string from = "sixteen bytes!!";
  std::vector<char> to(from.size() + 1, 0);
  cuda::waitAtLeast(stream.handle(), &ready, 1, "cuStreamWaitValue32 (ready)");
  cuda::queueCopy(stream.handle(), 0, host(to.data()), host(from.c_str()), from.size() + 1,
                  "cuMemcpyAsync");
  cuda::writeWord(stream.handle(), &done, 7, "cuStreamWriteValue32 (done)");
  CHECK(fake.pending() == 3);
  CHECK(to[0] == 0 && done == 0);
  ready = 1;
  CHECK(fake.run() == 3);
  CHECK(std::string(to.data()) == from);
  CHECK(done == 7);
}

TEST(fakeBatchRunsInOrder, "fake cuda: a batch waits for a value, then resets the word") {
  FakeCuda fake;
  cuda::Stream stream(0, cuda::Stream::OnDestroy::kRelease);
  alignas(4) uint32_t word = 0;
  cuda::runInOrder(stream.handle(),
                   {{cuda::WordOp::kWaitEquals, &word, 5}, {cuda::WordOp::kWrite, &word, 0}},
                   "cuStreamBatchMemOp");
  word = 4;
  fake.run();
  CHECK(word == 4 && fake.pending() == 2);  // equals, not at least
  word = 5;
  fake.run();
  CHECK(word == 0 && fake.pending() == 0);
}

TEST(fakeEventsFollowTheirStream, "fake cuda: an event reaches as its record runs") {
  FakeCuda fake;
  cuda::Stream producer(0, cuda::Stream::OnDestroy::kRelease);
  cuda::Stream consumer(0, cuda::Stream::OnDestroy::kRelease);
  alignas(4) uint32_t gate = 0;
  alignas(4) uint32_t after = 0;
  cuda::Event produced(0);
  CHECK(produced.reached());  // never recorded
  cuda::waitAtLeast(producer.handle(), &gate, 1, "cuStreamWaitValue32 (gate)");
  produced.record(producer.handle());
  produced.waitOn(consumer.handle());
  cuda::writeWord(consumer.handle(), &after, 1, "cuStreamWriteValue32 (after)");
  CHECK(!produced.reached());
  CHECK(after == 0);
  gate = 1;
  fake.run();
  CHECK(produced.reached());
  CHECK(after == 1);
}

TEST(fakeFailuresAreErrors, "fake cuda: a failed call throws with what it was") {
  FakeCuda fake;
  cuda::Stream stream(0, cuda::Stream::OnDestroy::kRelease);
  char from[8] = "bytes";
  char to[8] = {};
  fake.failNext("cuMemcpyAsync", CUDA_ERROR_LAUNCH_FAILED);
  CHECK(throwsError(
      [&] {
        cuda::queueCopy(stream.handle(), 0, host(to), host(from), sizeof(from),
                        "cuMemcpyAsync (out of a staging slot)");
      },
      "CUDA cuMemcpyAsync (out of a staging slot) failed: fake CUDA error 719"));
  CHECK(fake.pending() == 0 && to[0] == 0);
  // Only the next call fails.
  cuda::queueCopy(stream.handle(), 0, host(to), host(from), sizeof(from), "cuMemcpyAsync");
  CHECK(std::string(to) == "bytes");
  // A device that failed (a sticky error) answers every query with it.
  alignas(4) uint32_t never = 0;
  cuda::Event copied(0);
  cuda::waitAtLeast(stream.handle(), &never, 1, "cuStreamWaitValue32 (never)");
  copied.record(stream.handle());
  CHECK(!copied.reached());
  fake.failDevice();
  CHECK(throwsError([&] { copied.reached(); }, "CUDA cuEventQuery failed: fake CUDA error 700"));
}

// A recv of `bytes` posted as the copy engine posts one: its `ready`, `done` and `queued` words.
struct Recv {
  std::shared_ptr<Op> op = std::make_shared<Op>();
  std::vector<char> buffer;

  Recv(cuda::FlagSegment& flags, size_t bytes) : buffer(bytes, 0) {
    op->id = 42;
    op->request.kind = OpKind::kRecv;
    op->request.peer = 1;
    op->request.buffer.data = buffer.data();
    op->request.buffer.bytes = bytes;
    op->request.buffer.device = 0;
    op->config = std::make_shared<GroupConfig>(GroupConfig{"g", 0, 2});
    CopyEngineOp state;
    state.queued = flags.acquire();
    state.done = flags.acquire(kDoneSpan);
    state.ready = flags.acquire();
    op->channelOp = std::make_shared<TestCopyEngineOp>(std::move(state));
    op->outstanding = 1;  // as armed
  }
  const CopyEngineOp& state() const { return copyEngineOp(*op); }
};

struct Receiver {
  FakeCuda fake;
  CudaOps cudaOps{16};
  ProgressThread thread;
  std::vector<std::pair<std::shared_ptr<Op>, Status>> done;
  CopyEngineContext context{cudaOps, thread, 4, 1 << 20,
                            [this](const std::shared_ptr<Op>& op, const Status& status) {
                              done.emplace_back(op, status);
                            },
                            [](Peer&, std::string) {}};
  StagingRing ring{context.flags(), context.ringMemory(), 0, 64, 2, false, "a test ring"};

  char* slot(uint32_t index) { return reinterpret_cast<char*>(ring.slotAddress(index)); }
};

TEST(copyOutWaitsForReadyAndFull,
     "copy engine in-process: a copy out waits for `ready` and `full`") {
  Receiver receiver;
  cuda::FlagSegment& flags = receiver.context.flags();
  Recv recv(flags, 32);
  const StagedSlot slot{1, 0};
  std::memcpy(receiver.slot(1), "staged bytes of the sender", 27);
  const CUstream stream = receiver.context.copyOutStream(0);
  receiver.context.enqueueCopyOut(*recv.op, receiver.ring, slot, stream);
  CHECK(!receiver.context.recvLanded(*recv.op));
  flags.set(recv.state().ready);  // the caller's stream freed the buffer
  receiver.fake.run();
  CHECK(recv.buffer[0] == 0);     // the sender's copy into the slot has not landed
  flags.set(receiver.ring.full(slot));
  receiver.fake.run();
  CHECK(std::string(recv.buffer.data()) == "staged bytes of the sender");
  CHECK(flags.isSet(receiver.ring.emptied(slot)));
  CHECK(flags.wordOf(recv.state().done) == recv.state().done.value + kCopied);
  // Ends only once the sender's CPU also set `queued`.
  CHECK(!receiver.context.recvLanded(*recv.op));
  flags.set(recv.state().queued);
  CHECK(receiver.context.recvLanded(*recv.op) == std::optional<bool>(true));
  receiver.context.endRecv(recv.op, true);
  CHECK(receiver.done.size() == 1 && receiver.done[0].second.ok());
  CHECK(recv.op->outstanding == 0);
}

TEST(copyOutOfAGivenUpSend, "copy engine in-process: a recv whose sender gave up ends failed") {
  Receiver receiver;
  cuda::FlagSegment& flags = receiver.context.flags();
  Recv recv(flags, 16);
  flags.set(recv.state().done.plus(kSenderGaveUp));
  CHECK(!receiver.context.recvLanded(*recv.op));
  flags.set(recv.state().queued);
  CHECK(receiver.context.recvLanded(*recv.op) == std::optional<bool>(false));
  receiver.context.endRecv(recv.op, false);
  CHECK(receiver.done.size() == 1 && !receiver.done[0].second.ok());
  CHECK(receiver.done[0].second.message.find("recv on rank 0 from rank 1") != std::string::npos);
  CHECK(receiver.done[0].second.message.find("failed: the sender gave up") != std::string::npos);
}

TEST(copyOutFailureWritesNothing,
     "copy engine in-process: a copy out that fails to queue writes no word") {
  Receiver receiver;
  cuda::FlagSegment& flags = receiver.context.flags();
  Recv recv(flags, 16);
  const StagedSlot slot{0, 0};
  flags.set(recv.state().ready);
  flags.set(receiver.ring.full(slot));
  receiver.fake.failNext("cuMemcpyAsync");
  CHECK(throwsError(
      [&] {
        receiver.context.enqueueCopyOut(*recv.op, receiver.ring, slot,
                                        receiver.context.copyOutStream(0));
      },
      "cuMemcpyAsync (out of a staging slot) failed"));
  receiver.fake.run();
  CHECK(!flags.isSet(recv.state().done.plus(kCopied)));
  CHECK(!flags.isSet(receiver.ring.emptied(slot)));
}

TEST(emptyingWaitsForFull, "copy engine in-process: a slot no recv takes is emptied once full") {
  Receiver receiver;
  cuda::FlagSegment& flags = receiver.context.flags();
  const StagedSlot slot{1, 3};
  receiver.context.enqueueEmptying(receiver.ring, slot, receiver.context.copyOutStream(0));
  receiver.fake.run();
  CHECK(!flags.isSet(receiver.ring.emptied(slot)));
  flags.set(receiver.ring.full(slot));
  receiver.fake.run();
  CHECK(flags.isSet(receiver.ring.emptied(slot)));
}

}  // namespace
