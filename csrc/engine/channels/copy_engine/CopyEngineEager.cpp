// The copy engines' eager lanes (EagerLanes.h), as the progress thread sees them: a sender's
// announcement of its slot, a receiver's copy out at the match or its wait()'s, and what an
// eager op's failure gives back.
#include <string>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineChannel.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

EagerSlot slotOf(const EagerNotice& notice) {
  return EagerSlot{StagedSlot{notice.slot, notice.use}, notice.ringDevice};
}

}  // namespace

std::string CopyEngineChannel::announce(const Op& send) {
  const CopyEngineOp& state = copyEngineOp(send);
  if (!state.eager) return {};
  const EagerSlot& slot = state.eager->slot;
  const EagerNotice notice{slot.device, slot.staged.slot, slot.staged.use,
                           state.eager->after ? 1u : 0u};
  return toBytes(notice);
}

void CopyEngineChannel::prepareSend(const std::shared_ptr<Op>& send, Peer& destination) {
  const CopyEngineOp& state = copyEngineOp(*send);
  if (!state.eager) return;
  // Its copy holds the buffer until `copied`; the op ends once its receiver has also cleared it.
  Transfer transfer{.op = send,
                    .peer = &destination,
                    .slot = state.eager->slot.staged,
                    .eager = true,
                    .held = state.eager->after.has_value()};
  ++send->outstanding;
  moving_.push_back(std::move(transfer));
}

void CopyEngineChannel::clearedEager(const std::shared_ptr<Op>& send) {
  for (Transfer& transfer : moving_) {
    if (transfer.op == send) {
      transfer.cleared = true;  // it ends once its copy has run (finishMove)
      return;
    }
  }
  onDone_(send, Status::success());
}

bool CopyEngineChannel::outlivesWait(const Op& op) const {
  // An eager send's receiver may still need the slot's bytes, which its process's exit would
  // take away; a recv whose wait() queued its copy out ends when the bytes come.
  const CopyEngineOp& state = copyEngineOp(op);
  if (state.collective) return true;  // its wait() returns before its copy is queued, or has run
  if (op.isSend()) return state.eager.has_value();
  return state.eagerRecv && state.eagerRecv->claim.load() == EagerRecv::kByCaller;
}

void CopyEngineChannel::announced(Peer& source, const ReadyToSend& rts) {
  try {
    readEagerNotice(rts.channelData);
  } catch (const Error& error) {
    // Its match reads it again and fails the ops of that peer.
    log(LogLevel::kError, "from ", source.describe(), ": ", error.what());
    return;
  }
  lanes_.announced(LaneKey{source.address.processKey, rts.group, rts.tag}, rts.seq);
}

std::string CopyEngineChannel::armEager(const std::shared_ptr<Op>& recv, Peer& source,
                                        const std::string& announced) {
  const EagerNotice notice = readEagerNotice(announced);
  const EagerSlot eager = slotOf(notice);
  const std::shared_ptr<StagingRing> ring = lanes_.ring(laneOf(*recv, source.address.processKey));
  if (!ring || ring->device() != eager.device || eager.staged.slot >= ring->slots()) {
    fail(recv->describe(), " matched an eager send whose slot (cuda:", eager.device, " slot ",
         eager.staged.slot, ") this process does not have");
  }
  const CopyEngineOp& state = copyEngineOp(*recv);
  ++recv->outstanding;
  ++eagerRecvs_;
  if (state.eagerRecv && !state.eagerRecv->claimBy(EagerRecv::kByProgress)) {
    // Its wait() predicted the slot and queues the copy out on the caller's stream.
    const EagerSlot predicted = eagerSlotOf(state.eagerRecv->seq, ring->device());
    moving_.push_back(
        Transfer{.op = recv, .peer = &source, .callerCopiesOut = state.eagerRecv});
    if (predicted.staged.slot != eager.staged.slot || predicted.staged.use != eager.staged.use) {
      fail(recv->describe(), " expected its message in eager slot ", predicted.staged.slot,
           " use ", predicted.staged.use, " and it came in slot ", eager.staged.slot, " use ",
           eager.staged.use);
    }
    return {};
  }
  Transfer transfer{.op = recv, .peer = &source, .ring = ring, .slot = eager.staged};
  if (notice.held) {
    // Its copy is not queued yet: a copy out queued now would wait for unsubmitted work.
    transfer.held = true;
    moving_.push_back(std::move(transfer));
    return {};
  }
  {
    cuda::ContextGuard context(ring->device());
    enqueueCopyOut(*recv, *ring, eager.staged, copyOutStream(ring->device()));
  }
  moving_.push_back(std::move(transfer));
  flags_.set(state.queued);
  return {};
}

bool CopyEngineChannel::emptyHeldSlots() {
  bool emptied = false;
  for (auto it = heldSlots_.begin(); it != heldSlots_.end();) {
    if (!flags_.isSet(it->ring->full(it->slot))) {
      ++it;
      continue;
    }
    try {
      cuda::ContextGuard context(it->ring->device());
      enqueueEmptying(*it->ring, it->slot, copyOutStream(it->ring->device()));
    } catch (const Error& error) {
      log(LogLevel::kError, "an eager slot is lost: ", error.what());
    }
    it = heldSlots_.erase(it);
    emptied = true;
  }
  return emptied;
}

bool CopyEngineChannel::fillHeld(Transfer& send) {
  Op& op = *send.op;
  CopyEngineOp& state = copyEngineOp(op);
  if (!op.finished()) {
    try {
      if (!lanes_.fill(op, laneOf(op, send.peer->address.processKey), *state.eager,
                       *state.produced, *state.copied)) {
        return false;
      }
      send.held = false;
      flags_.set(state.queued);
      return true;
    } catch (const Error& error) {
      onDone_(send.op, Status::failure(StatusCode::kTransport, std::string(reasonOf(error))));
    }
  }
  // Failed (its timeout, or its lane gone) before its slot was emptied: its copy is never
  // queued, and finishMove ends it as `copied`, never recorded, reads reached.
  send.held = false;
  state.copied->markReached();
  return true;
}

bool CopyEngineChannel::copyOutOnceFull(Transfer& recv) {
  Op& op = *recv.op;
  const CopyEngineOp& state = copyEngineOp(op);
  bool queued = false;
  if (flags_.isSet(recv.ring->full(*recv.slot))) {
    try {
      cuda::ContextGuard context(recv.ring->device());
      enqueueCopyOut(op, *recv.ring, *recv.slot, copyOutStream(recv.ring->device()));
      queued = true;
    } catch (const Error& error) {
      onDone_(recv.op, Status::failure(StatusCode::kTransport, std::string(reasonOf(error))));
    }
  } else if (!op.finished()) {
    return false;
  }
  // Without a copy out (it failed, or the sender's copy never came and the slot stays full
  // for the lane's end), it ends as one the sender gave up.
  if (!queued) flags_.set(state.done.plus(kSenderGaveUp));
  recv.held = false;
  flags_.set(state.queued);
  return true;
}

void CopyEngineChannel::discard(Peer& source, const ReadyToSend& rts, Op* recv) {
  thread_.check("CopyEngineChannel::discard");
  if (recv && recv->channelOp && recv->channel == ChannelKind::kCopyEngine) {
    const auto& eagerRecv = copyEngineOp(*recv).eagerRecv;
    // Its wait() queued, or ended() releases, the copy out that empties the slot.
    if (eagerRecv && !eagerRecv->claimBy(EagerRecv::kByProgress)) return;
  }
  try {
    const EagerNotice notice = readEagerNotice(rts.channelData);
    const EagerSlot eager = slotOf(notice);
    const auto ring = lanes_.ring(LaneKey{source.address.processKey, rts.group, rts.tag});
    if (!ring || eager.staged.slot >= ring->slots()) return;
    if (notice.held) {
      // Its copy is not queued yet: emptied once it has landed (emptyHeldSlots).
      heldSlots_.push_back(HeldSlot{ring, eager.staged});
      return;
    }
    cuda::ContextGuard context(ring->device());
    enqueueEmptying(*ring, eager.staged, copyOutStream(ring->device()));
  } catch (const Error& error) {
    log(LogLevel::kError, "an eager slot of ", source.describe(), " is lost: ", error.what());
  }
}

void CopyEngineChannel::releaseEagerRecv(EagerRecv& recv) {
  std::lock_guard<std::mutex> lock(recv.mutex);
  const EagerSlot eager = eagerSlotOf(recv.seq, recv.ring->device());
  // The sender may never fill it: the caller's wait for `full` must not park its stream.
  flags_.set(recv.ring->full(eager.staged));
  if (recv.queued) return;  // that copy out runs now, into a failed recv, and empties the slot
  recv.abandoned = true;
  try {
    cuda::ContextGuard context(recv.ring->device());
    enqueueEmptying(*recv.ring, eager.staged, copyOutStream(recv.ring->device()));
  } catch (const Error& error) {
    log(LogLevel::kError, "an eager slot is lost: ", error.what());
  }
}

bool CopyEngineChannel::finishCallersCopyOut(Transfer& transfer) {
  EagerRecv& recv = *transfer.callerCopiesOut;
  {
    std::lock_guard<std::mutex> lock(recv.mutex);
    // Abandoned: the op failed before its wait() queued the copy out, which never will.
    if (!recv.abandoned && !(recv.queued && recv.copied->reached())) return false;
  }
  --transfer.op->outstanding;
  onDone_(transfer.op, Status::success());  // a failed op stays failed
  return true;
}

}  // namespace smfree::engine
