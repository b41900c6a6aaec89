// The copy engines' work on the caller's thread: what an op enqueues at its post (on the
// caller's stream; an eager send's copy on a stream of its own), and the fence its wait() puts
// on the caller's stream; and what the progress thread gives back once the op has ended.
#include "engine/channels/copy_engine/CopyEngineChannel.h"
#include "engine/channels/copy_engine/CopyEngineChannelOp.h"

#include <thread>

#include "engine/Log.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/Spin.h"
#include "engine/cuda/Bounce.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

std::shared_ptr<ChannelOp> CopyEngineChannel::prepare(Op& op, const PostOptions& options) {
  cuda::FlagSegment& flags = context_.flags();
  // Where copies within this GPU will bounce is settled (and that GPU's context made) at the
  // device's first op, not in the middle of a transfer.
  if (cuda::localCopies() == cuda::LocalCopies::kPeerGpu) {
    cuda::bounceDevice(op.request.buffer.device);
  }
  context_.cudaOps().admit(options.timeout);
  CopyEngineOp state;  // moved into its CopyEngineChannelOp
  // A collective's piece: a collective lane decides, at this post, which side queues its copy.
  const bool byLane = collective_.takes(op, options);
  try {
    state.queued = flags.acquire();
    if (op.isSend()) {
      const int device = op.request.buffer.device;
      state.produced = cuda::takeEvent(device);
      state.copied = cuda::takeEvent(device);
      state.produced->record(static_cast<CUstream>(op.request.stream));
      if (eager_.lanes().enabled() && !options.peerKey.empty() && !op.isCollective()) {
        state.eager = eager_.lanes().push(op, CopyEngineContext::laneOf(op, options.peerKey),
                                          *state.produced, *state.copied);
        if (state.eager) {
          // Its wait() makes the stream wait for `copied` at once; a held one's once the
          // progress thread has queued its copy.
          if (!state.eager->after) flags.set(state.queued);
          eager_.countSend();
        }
      }
    } else {
      state.done = flags.acquire(kDoneSpan);
      state.ready = flags.acquire();
      context_.cudaOps().writeFromStream(op, state.ready);
      if (byLane) {  // its buffer is free: a collective lane's pull waits for it
        state.produced = cuda::takeEvent(op.request.buffer.device);
        state.produced->record(static_cast<CUstream>(op.request.stream));
      }
      // Only a recv that fits a slot can learn its message is eager; others cost nothing here.
      const uint64_t bytes = op.request.buffer.bytes;
      if (options.placeKnown && bytes != 0 && bytes <= eager_.lanes().slotBytes() &&
          !op.isCollective()) {
        state.eagerRecv = std::make_shared<EagerRecv>();
        state.eagerRecv->lane = CopyEngineContext::laneOf(op, options.peerKey);
        state.eagerRecv->seq = op.seq;
        state.eagerRecv->buffer = op.request.buffer;
        eager_.lanes().posted(state.eagerRecv);
      }
    }
    if (byLane) collective_.post(op, options, state);
  } catch (...) {
    // A value of 0 is never handed out: those words were not acquired.
    for (const cuda::Flag* flag :
         {&state.queued, &state.done, &state.ready, &state.producedWord}) {
      if (flag->value != 0) flags.release(*flag);
    }
    context_.cudaOps().retire();
    throw;
  }
  return std::make_shared<CopyEngineChannelOp>(*this, op, std::move(state));
}

bool CopyEngineChannel::fenceQueued(const CopyEngineFence& fence) {
  cuda::FlagSegment& flags = context_.flags();
  if (flags.isSet(fence.queued)) return true;
  // A recv whose message the lane shows to be eager queues its own copy out (waitOnStream).
  return fence.eagerRecv && eager_.lanes().claimable(*fence.eagerRecv);
}

void CopyEngineChannel::waitOnStream(void* stream, int device, const CopyEngineFence& fence) {
  cuda::FlagSegment& flags = context_.flags();
  if (fence.eagerRecv) {
    if (eager_.lanes().queueCopiesOut(*fence.eagerRecv, static_cast<CUstream>(stream))) return;
    // The progress thread took it meanwhile, at the match or the op's end, and sets `queued`
    // as it is done.
    // The progress thread already holds the copy out and sets `queued` once it is queued:
    // the deadline only guards against a stuck progress thread.
    SpinDeadline deadline(std::chrono::seconds(60), "a wait() for its recv's copy to be queued");
    while (!flags.isSet(fence.queued)) {
      deadline.check();
      std::this_thread::yield();
    }
  }
  if (fence.copied) {
    fence.copied->waitOn(static_cast<CUstream>(stream));
    return;
  }
  cuda::ContextGuard context(device);
  // The flag says a peer's copy engine finished writing our memory over NVLink.
  cuda::waitForRemoteWrites(static_cast<CUstream>(stream), device,
                            flags.cudaAddress(fence.done.index), fence.done.value,
                            "cuStreamWaitValue32 (done)");
}

void CopyEngineChannel::ended(Op& op, const Status& status) {
  cuda::FlagSegment& flags = context_.flags();
  // No copy will signal a failed op or an empty one: no user stream stays parked (a send's
  // `copied`, never recorded then, holds no wait). After the callback, so a caller that sees
  // `queued` also sees the error.
  const CopyEngineOp& state = copyEngineOp(op);
  // No wait() may claim a copy out now; one that did must not wait for a slot never filled.
  if (state.eagerRecv && !state.eagerRecv->claimBy(EagerRecv::kByProgress) && !status.ok()) {
    eager_.release(*state.eagerRecv);
  }
  if (state.collective && !status.ok()) collective_.ended(op);
  if (status.ok() && op.request.desc.bytes != 0) return;
  flags.set(state.queued);
  if (state.done.value != 0) flags.set(state.done);
}

void CopyEngineChannel::release(Op& op) {
  cuda::FlagSegment& flags = context_.flags();
  // No copy can touch `done` any more; `ready` waits for its own stream. Events go with the
  // last holder (a work may still make a stream wait on `copied`).
  CopyEngineOp& state = copyEngineOp(op);
  flags.release(state.queued);
  if (state.done.value != 0) flags.release(state.done);
  if (!op.isSend()) context_.cudaOps().releaseOnceWritten(state.ready);
  if (state.producedWord.value != 0) context_.cudaOps().releaseOnceWritten(state.producedWord);
  if (state.collective) collective_.lanes().finished(*state.collective);
  state.produced.reset();
  state.copied.reset();
  context_.cudaOps().retire();
}

}  // namespace smfree::engine
