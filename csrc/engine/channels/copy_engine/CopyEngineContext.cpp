#include "engine/channels/copy_engine/CopyEngineContext.h"

#include "engine/Log.h"
#include "engine/PeerAddress.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

CopyEngineContext::CopyEngineContext(CudaOps& cudaOps, const ProgressThread& thread,
                                     size_t ipcCacheSize, uint64_t ringMemoryBytes, Done onDone,
                                     Notify notify)
    : cudaOps_(cudaOps),
      thread_(thread),
      flags_(cudaOps.flags()),
      ipc_(ipcCacheSize),
      ringMemory_(ringMemoryBytes),
      onDone_(std::move(onDone)),
      notify_(std::move(notify)) {}

cuda::RemoteFlagSegment& CopyEngineContext::flagsOf(const std::string& key,
                                                    const PeerAddress& address, int ownerPidfd) {
  std::lock_guard<std::mutex> lock(peerFlagsMutex_);
  auto& flags = peerFlags_[key];
  if (!flags) {
    flags = std::make_unique<cuda::RemoteFlagSegment>(
        ownerPidfd, address.flagSegment, address.describe());
  }
  return *flags;
}

CUstream CopyEngineContext::dmaStream(int localDevice, int peerDevice) {
  auto& stream = streams_[{localDevice, peerDevice}];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(localDevice, cuda::Stream::OnDestroy::kRelease);
    log(LogLevel::kInfo, "DMA stream for cuda:", localDevice, " -> peer cuda:", peerDevice);
  }
  return stream->handle();
}

CUstream CopyEngineContext::copyOutStream(int device) {
  auto& stream = copyOutStreams_[device];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(device, cuda::Stream::OnDestroy::kRelease);
    log(LogLevel::kInfo, "staging copy-out stream for cuda:", device);
  }
  return stream->handle();
}

LaneKey CopyEngineContext::laneOf(const Op& op, const std::string& peerKey) {
  return LaneKey{peerKey, op.groupId, op.request.tag};
}

void CopyEngineContext::enqueueCopyOut(const Op& recv, StagingRing& ring, const StagedSlot& slot,
                                       CUstream stream) {
  const CopyEngineOp& state = copyEngineOp(recv);
  const int device = ring.device();
  // Both submitted before the notice: `ready` when the recv was posted, `full` by the sender.
  cuda::waitAtLeast(stream, flags_.cudaAddress(state.ready.index), state.ready.value,
                    "cuStreamWaitValue32 (ready)");
  const cuda::Flag full = ring.full(slot);
  cuda::waitForRemoteWrites(stream, device, flags_.cudaAddress(full.index), full.value,
                            "cuStreamWaitValue32 (staging slot full)");
  cuda::queueCopy(stream, device,
                  cuda::Place::of(recv.request.buffer.data, recv.request.buffer.device),
                  {ring.slotAddress(slot.slot), device}, recv.request.buffer.bytes,
                  "cuMemcpyAsync (out of a staging slot)");
  const cuda::Flag copied = state.done.plus(kCopied);
  cuda::writeWord(stream, flags_.cudaAddress(copied.index), copied.value,
                  "cuStreamWriteValue32 (done)");
  const cuda::Flag emptied = ring.emptied(slot);
  cuda::writeWord(stream, flags_.cudaAddress(emptied.index), emptied.value,
                  "cuStreamWriteValue32 (staging slot emptied)");
}

void CopyEngineContext::enqueueEmptying(StagingRing& ring, const StagedSlot& slot,
                                        CUstream stream) {
  const cuda::Flag full = ring.full(slot);
  cuda::waitAtLeast(stream, flags_.cudaAddress(full.index), full.value,
                    "cuStreamWaitValue32 (staging slot full)");
  const cuda::Flag emptied = ring.emptied(slot);
  cuda::writeWord(stream, flags_.cudaAddress(emptied.index), emptied.value,
                  "cuStreamWriteValue32 (staging slot emptied)");
}

std::optional<bool> CopyEngineContext::recvLanded(const Op& recv) const {
  const CopyEngineOp& state = copyEngineOp(recv);
  const cuda::Flag& done = state.done;
  if (!flags_.isSet(done.plus(kCopied)) || !flags_.isSet(state.queued)) return std::nullopt;
  return flags_.wordOf(done) == done.value + kCopied;
}

void CopyEngineContext::endRecv(const std::shared_ptr<Op>& recv, bool copied) {
  if (copied) {
    end(recv, Status::success());
  } else {
    end(recv, Status::failure(StatusCode::kAborted,
                              concat(recv->describe(), " failed: the sender gave up")));
  }
}

}  // namespace smfree::engine
