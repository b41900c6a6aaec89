// The copy engines' staging rings (StagingRing.h), as the progress thread sees them: a send
// held until its receiver is ready or a slot of the receiver's ring is free, its copy into
// that slot, and the receiver's copy out of the slot once the sender's notice names it.
#include <algorithm>
#include <string>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineChannel.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {
namespace {

}  // namespace

bool CopyEngineChannel::stageable(uint64_t bytes) const {
  return bytes >= kStagingMinBytes && bytes <= stagingBytes_;
}

std::shared_ptr<StagingRing> CopyEngineChannel::ringFor(const Peer& source, int device) {
  auto [it, created] = rings_.try_emplace(RingKey{source.address.processKey, device});
  if (created) {
    try {
      it->second = std::make_shared<StagingRing>(
          flags_, ringMemory_, device, stagingBytes_, kStagingSlots, false,
          concat("staging ring of ", kStagingSlots, " x ", stagingBytes_, " B for sends from ",
                 source.describe()));
    } catch (const Error& error) {
      RingMemory::refused(concat("no staging ring on cuda:", device, " for sends from ",
                         source.describe(), " (", reasonOf(error),
                         "): they wait for this process's streams"));
    }
  }
  return it->second;
}

void CopyEngineChannel::submitStaged(Transfer send, const StagedSlot& slot) {
  Op& op = *send.op;
  const int device = op.request.buffer.device;
  try {
    cuda::ContextGuard context(device);
    enqueueStagedCopy(send, slot, dmaStream(device, send.remote->device()));
  } catch (const Error&) {
    giveUp(send);
    throw;
  }
  send.remote->take(slot);
  send.slot = slot;
  // The receiver's `queued` is its own to set, once it has submitted the copy out.
  notify_(*send.peer, toBytes(StagedNotice{send.clearance->header.recvId, send.remote->device(),
                                           slot.slot, slot.use, 0}));
  flags_.set(copyEngineOp(op).queued);
  ++op.outstanding;
  ++stagedSends_;
  moving_.push_back(std::move(send));
}

void CopyEngineChannel::enqueueStagedCopy(Transfer& send, const StagedSlot& slot,
                                          CUstream stream) {
  const Op& op = *send.op;
  const CopyEngineOp& state = copyEngineOp(op);
  // `produced` was submitted when the send was posted; the slot is empty (nextFree()).
  state.produced->waitOn(stream);
  const CUdeviceptr to = send.remote->slotAddress(slot, op.request.buffer.device);
  cuda::queueCopy(stream, op.request.buffer.device, {to, send.remote->device()},
                  cuda::Place::of(op.request.buffer.data, op.request.buffer.device),
                  op.request.buffer.bytes, "cuMemcpyAsync (to a staging slot)");
  state.copied->record(stream);
  const cuda::Flag full = send.remote->full(slot);
  cuda::writeWord(stream, send.peerFlags->cudaAddress(full.index), full.value,
                  "cuStreamWriteValue32 (staging slot full)");
}

void CopyEngineChannel::onNotice(Peer& source, const std::string& data) {
  const StagedNotice notice = readStagedNotice(data);
  const auto ringIt = rings_.find(RingKey{source.address.processKey, notice.ringDevice});
  if (ringIt == rings_.end() || !ringIt->second || notice.slot >= ringIt->second->slots()) {
    log(LogLevel::kError, "ignored a staging notice from ", source.describe(),
        " for a slot this process does not have (cuda:", notice.ringDevice, " slot ",
        notice.slot, ")");
    return;
  }
  StagingRing& ring = *ringIt->second;
  const StagedSlot slot{notice.slot, notice.use};
  auto recv = std::find_if(moving_.begin(), moving_.end(), [&](const Transfer& transfer) {
    return transfer.op->id == notice.recvId && !transfer.op->isSend() && !transfer.slot;
  });
  try {
    cuda::ContextGuard context(ring.device());
    const CUstream stream = copyOutStream(ring.device());
    if (recv == moving_.end()) {
      enqueueEmptying(ring, slot, stream);  // the recv is gone; the slot must still come back
      return;
    }
    enqueueCopyOut(*recv->op, ring, slot, stream);
  } catch (const Error& error) {
    if (recv != moving_.end()) {
      abandon(recv, Status::failure(StatusCode::kTransport, error.what()));
    } else {
      log(LogLevel::kError, "a staging slot from ", source.describe(), " is lost: ", error.what());
    }
    return;
  }
  recv->ring = ringIt->second;
  recv->slot = slot;
  ++stagedRecvs_;
  flags_.set(copyEngineOp(*recv->op).queued);
}

void CopyEngineChannel::enqueueCopyOut(const Op& recv, StagingRing& ring, const StagedSlot& slot,
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

void CopyEngineChannel::enqueueEmptying(StagingRing& ring, const StagedSlot& slot,
                                        CUstream stream) {
  const cuda::Flag full = ring.full(slot);
  cuda::waitAtLeast(stream, flags_.cudaAddress(full.index), full.value,
                    "cuStreamWaitValue32 (staging slot full)");
  const cuda::Flag emptied = ring.emptied(slot);
  cuda::writeWord(stream, flags_.cudaAddress(emptied.index), emptied.value,
                  "cuStreamWriteValue32 (staging slot emptied)");
}

bool CopyEngineChannel::advanceHeld() {
  bool advanced = false;
  for (auto it = held_.begin(); it != held_.end();) {
    const bool ready = it->peerFlags->isSet(it->clearance->header.ready);
    std::optional<StagedSlot> slot;
    if (!ready) slot = it->remote->nextFree(*it->peerFlags);
    if (!ready && !slot) {
      ++it;
      continue;
    }
    Transfer send = std::move(*it);
    it = held_.erase(it);
    --send.op->outstanding;
    const std::shared_ptr<Op> op = send.op;
    try {
      if (slot) {
        submitStaged(std::move(send), *slot);
      } else {
        submitDirect(std::move(send));
      }
    } catch (const Error& error) {
      onDone_(op, Status::failure(StatusCode::kTransport, error.what()));
    }
    advanced = true;
  }
  return advanced;
}

}  // namespace smfree::engine
