// The copy engines' work on the caller's thread: what an op enqueues at its post (on the
// caller's stream; an eager send's copy on a stream of its own), and the fence its wait() puts
// on the caller's stream; and what the progress thread gives back once the op has ended.
#include "engine/channels/copy_engine/CopyEngineChannel.h"

#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

CudaFence CopyEngineChannel::prepare(Op& op, const PostOptions& options) {
  cudaOps_.admit(options.timeout);
  auto state = std::make_unique<CopyEngineOp>();
  try {
    state->queued = flags_.acquire();
    if (op.isSend()) {
      const int device = op.request.buffer.device;
      state->produced = cuda::takeEvent(device);
      state->copied = cuda::takeEvent(device);
      state->produced->record(static_cast<CUstream>(op.request.stream));
      const uint64_t bytes = op.request.buffer.bytes;
      if (bytes != 0 && bytes <= eagerBytes_ && !options.peerKey.empty()) {
        pushEagerly(op, *state, options.peerKey);
      }
    } else {
      state->done = flags_.acquire(kDoneSpan);
      state->ready = flags_.acquire();
      cudaOps_.writeFromStream(op, state->ready);
    }
  } catch (...) {
    // A value of 0 is never handed out: those words were not acquired.
    if (state->queued.value != 0) flags_.release(state->queued);
    if (state->done.value != 0) flags_.release(state->done);
    if (state->ready.value != 0) flags_.release(state->ready);
    cudaOps_.retire();
    throw;
  }
  const CudaFence fence{ChannelKind::kCopyEngine, state->queued, state->done, state->copied,
                        nullptr};
  op.channelState = std::move(state);
  return fence;
}

void CopyEngineChannel::pushEagerly(Op& send, CopyEngineOp& state, const std::string& peerKey) {
  std::lock_guard<std::mutex> lock(eagerMutex_);
  const auto known = eagerRemotes_.find(peerKey);
  if (known == eagerRemotes_.end()) return;  // its first clear-to-send has not come yet
  RemoteStagingRing& ring = *known->second.ring;
  cuda::RemoteFlagSegment& words = *known->second.words;
  const uint64_t bytes = send.request.buffer.bytes;
  if (bytes > ring.slotBytes()) return;
  const std::optional<StagedSlot> slot = ring.nextFree(words);
  if (!slot) return;  // the receiver has not copied the slot out yet: a rendezvous
  const int device = send.request.buffer.device;
  cuda::ContextGuard context(device);
  const CUstream stream = eagerStream(device, ring.device());
  // `produced` was just recorded; the slot is empty. No wait for anything of the receiver's.
  state.produced->waitOn(stream);
  cuda::check(cuda::driver().cuMemcpyAsync(ring.slotAddress(*slot, device),
                                           reinterpret_cast<CUdeviceptr>(send.request.buffer.data),
                                           bytes, stream),
              "cuMemcpyAsync (to an eager slot)");
  state.copied->record(stream);
  const cuda::Flag full = ring.full(*slot);
  cuda::writeWord(stream, words.cudaAddress(full.index), full.value,
                  "cuStreamWriteValue32 (eager slot full)");
  ring.take(*slot);
  state.eager = slot;
  state.eagerDevice = ring.device();
  flags_.set(state.queued);
  eagerSends_.fetch_add(1, std::memory_order_relaxed);
}

CUstream CopyEngineChannel::eagerStream(int localDevice, int peerDevice) {
  auto& stream = eagerStreams_[{localDevice, peerDevice}];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(localDevice, cuda::Stream::OnDestroy::kRelease);
    log(LogLevel::kInfo, "eager stream for cuda:", localDevice, " -> peer cuda:", peerDevice);
  }
  return stream->handle();
}

bool CopyEngineChannel::fenceQueued(const CudaFence& fence) {
  return flags_.isSet(fence.queued);
}

void CopyEngineChannel::waitOnStream(void* stream, int device, const CudaFence& fence) {
  if (fence.copied) {
    fence.copied->waitOn(static_cast<CUstream>(stream));
    return;
  }
  cuda::ContextGuard context(device);
  // The flag says a peer's copy engine finished writing our memory over NVLink.
  cuda::waitForRemoteWrites(static_cast<CUstream>(stream), device,
                            flags_.cudaAddress(fence.done.index), fence.done.value,
                            "cuStreamWaitValue32 (done)");
}

void CopyEngineChannel::ended(Op& op, const Status& status) {
  // No copy will signal a failed op or an empty one: no user stream stays parked (a send's
  // `copied`, never recorded then, holds no wait). After the callback, so a caller that sees
  // `queued` also sees the error.
  if (status.ok() && op.request.desc.bytes != 0) return;
  const CopyEngineOp& state = copyEngineOp(op);
  flags_.set(state.queued);
  if (!op.isSend()) flags_.set(state.done);
}

void CopyEngineChannel::release(Op& op) {
  // No copy can touch `done` any more; `ready` waits for its own stream. Events go with the
  // last holder (a work may still make a stream wait on `copied`).
  CopyEngineOp& state = copyEngineOp(op);
  flags_.release(state.queued);
  if (!op.isSend()) {
    flags_.release(state.done);
    cudaOps_.releaseOnceWritten(state.ready);
  }
  state.produced.reset();
  state.copied.reset();
  cudaOps_.retire();
}

}  // namespace smfree::engine
