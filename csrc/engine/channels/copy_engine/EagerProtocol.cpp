#include "engine/channels/copy_engine/EagerProtocol.h"

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/channels/copy_engine/CopyEnginePeer.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

EagerSlot slotOf(const EagerNotice& notice) {
  return EagerSlot{StagedSlot{notice.slot, notice.use}, notice.ringDevice};
}

auto flag(const char* name, uint32_t word, const cuda::Flag& wanted) {
  return concat(name, " ", wanted.index, ":", word, "/", wanted.value);
}

}  // namespace

void EagerProtocol::moveTo(EagerSendTransfer& send, EagerSendState to) {
  kEagerSendStates.advance(send.state, to, [&] { return send.op->describe(); });
}

void EagerProtocol::moveTo(EagerRecvTransfer& recv, EagerRecvState to) {
  kEagerRecvStates.advance(recv.state, to, [&] { return recv.op->describe(); });
}

std::string EagerProtocol::announce(const Op& send) const {
  const CopyEngineOp& state = copyEngineOp(send);
  if (!state.eager) return {};
  const EagerSlot& slot = state.eager->slot;
  const EagerNotice notice{slot.device, slot.staged.slot, slot.staged.use,
                           state.eager->after ? 1u : 0u};
  return toBytes(notice);
}

void EagerProtocol::prepareSend(const std::shared_ptr<Op>& send, Peer& destination) {
  const CopyEngineOp& state = copyEngineOp(*send);
  if (!state.eager) return;
  // Its copy holds the buffer until `copied`; the op ends once its receiver has also cleared it.
  ++send->outstanding;
  sends_.push_back(EagerSendTransfer{
      send, &destination, state.eager->slot.staged,
      state.eager->after ? EagerSendState::kHeld : EagerSendState::kQueued});
}

void EagerProtocol::cleared(const std::shared_ptr<Op>& send) {
  for (EagerSendTransfer& transfer : sends_) {
    if (transfer.op != send) continue;
    // It ends once its copy has run (finish).
    moveTo(transfer, transfer.state == EagerSendState::kHeld ? EagerSendState::kHeldCleared
                                                             : EagerSendState::kQueuedCleared);
    return;
  }
  context_.done(send, Status::success());  // landed: its transfer already ended
}

void EagerProtocol::open(const Op& send, const Peer& destination,
                         std::shared_ptr<RemoteStagingRing> ring,
                         cuda::RemoteFlagSegment& words) {
  if (!ring) return;
  cuda::ContextGuard context(send.request.buffer.device);  // open() registers the words
  lanes_.open(CopyEngineContext::laneOf(send, processKeyOf(destination)), std::move(ring),
              words);
}

void EagerProtocol::announced(const Peer& source, const std::string& channelData,
                              const LaneKey& lane, uint64_t seq) {
  try {
    readEagerNotice(channelData);
  } catch (const Error& error) {
    // Its match reads it again and fails the ops of that peer.
    log(LogLevel::kError, "from ", describePeer(source), ": ", error.what());
    return;
  }
  lanes_.announced(lane, seq);
}

std::string EagerProtocol::ringData(const Op& recv, const Peer& source) {
  std::string eager;
  const Buffer& buffer = recv.request.buffer;
  if (buffer.bytes <= lanes_.slotBytes()) {
    const auto ring =
        lanes_.ringFor(CopyEngineContext::laneOf(recv, processKeyOf(source)), buffer.device);
    if (ring) ring->appendTo(eager);
  }
  return eager;
}

std::string EagerProtocol::arm(const std::shared_ptr<Op>& recv, Peer& source,
                               const std::string& announced) {
  const EagerNotice notice = readEagerNotice(announced);
  const EagerSlot eager = slotOf(notice);
  const std::shared_ptr<StagingRing> ring =
      lanes_.ring(CopyEngineContext::laneOf(*recv, processKeyOf(source)));
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
    recvs_.push_back(EagerRecvTransfer{recv, nullptr, {}, state.eagerRecv,
                                       EagerRecvState::kCallerCopiesOut});
    if (predicted.staged.slot != eager.staged.slot || predicted.staged.use != eager.staged.use) {
      fail(recv->describe(), " expected its message in eager slot ", predicted.staged.slot,
           " use ", predicted.staged.use, " and it came in slot ", eager.staged.slot, " use ",
           eager.staged.use);
    }
    return {};
  }
  if (notice.held) {
    // Its copy is not queued yet: a copy out queued now would wait for unsubmitted work.
    recvs_.push_back(
        EagerRecvTransfer{recv, ring, eager.staged, nullptr, EagerRecvState::kHeld});
    return {};
  }
  {
    cuda::ContextGuard context(ring->device());
    context_.enqueueCopyOut(*recv, *ring, eager.staged, context_.copyOutStream(ring->device()));
  }
  recvs_.push_back(EagerRecvTransfer{recv, ring, eager.staged, nullptr,
                                     EagerRecvState::kCopyingOut});
  context_.flags().set(state.queued);
  return {};
}

void EagerProtocol::discard(const Peer& source, const std::string& channelData,
                            const LaneKey& lane) {
  try {
    const EagerNotice notice = readEagerNotice(channelData);
    const EagerSlot eager = slotOf(notice);
    const auto ring = lanes_.ring(lane);
    if (!ring || eager.staged.slot >= ring->slots()) return;
    if (notice.held) {
      // Its copy is not queued yet: emptied once it has landed (emptyHeldSlots).
      heldSlots_.push_back(HeldSlot{ring, eager.staged});
      return;
    }
    cuda::ContextGuard context(ring->device());
    context_.enqueueEmptying(*ring, eager.staged, context_.copyOutStream(ring->device()));
  } catch (const Error& error) {
    log(LogLevel::kError, "an eager slot of ", describePeer(source), " is lost: ", error.what());
  }
}

void EagerProtocol::release(EagerRecv& recv) {
  std::lock_guard<std::mutex> lock(recv.mutex);
  const EagerSlot eager = eagerSlotOf(recv.seq, recv.ring->device());
  // The sender may never fill it: the caller's wait for `full` must not park its stream.
  context_.flags().set(recv.ring->full(eager.staged));
  if (recv.queued) return;  // that copy out runs now, into a failed recv, and empties the slot
  recv.abandoned = true;
  try {
    cuda::ContextGuard context(recv.ring->device());
    context_.enqueueEmptying(*recv.ring, eager.staged,
                             context_.copyOutStream(recv.ring->device()));
  } catch (const Error& error) {
    log(LogLevel::kError, "an eager slot is lost: ", error.what());
  }
}

bool EagerProtocol::emptyHeldSlots() {
  bool emptied = false;
  for (auto it = heldSlots_.begin(); it != heldSlots_.end();) {
    if (!context_.flags().isSet(it->ring->full(it->slot))) {
      ++it;
      continue;
    }
    try {
      cuda::ContextGuard context(it->ring->device());
      context_.enqueueEmptying(*it->ring, it->slot, context_.copyOutStream(it->ring->device()));
    } catch (const Error& error) {
      log(LogLevel::kError, "an eager slot is lost: ", error.what());
    }
    it = heldSlots_.erase(it);
    emptied = true;
  }
  return emptied;
}

bool EagerProtocol::progress() {
  const auto finished = [this](auto& transfer) { return finish(transfer); };
  const bool sent = eraseFinished(sends_, finished);
  return eraseFinished(recvs_, finished) || sent;
}

bool EagerProtocol::fill(EagerSendTransfer& send) {
  Op& op = *send.op;
  CopyEngineOp& state = copyEngineOp(op);
  const bool cleared = send.state == EagerSendState::kHeldCleared;
  if (!op.finished()) {
    try {
      if (!lanes_.fill(op, CopyEngineContext::laneOf(op, processKeyOf(*send.peer)),
                       *state.eager, *state.produced, *state.copied)) {
        return false;
      }
      moveTo(send, cleared ? EagerSendState::kQueuedCleared : EagerSendState::kQueued);
      context_.flags().set(state.queued);
      return true;
    } catch (const Error& error) {
      context_.done(send.op, Status::failure(StatusCode::kChannel, std::string(reasonOf(error))));
    }
  }
  // Failed (its timeout, or its lane gone) before its slot was emptied: its copy is never
  // queued, and finish() ends it as `copied`, never recorded, reads reached.
  moveTo(send, EagerSendState::kUnfilled);
  state.copied->markReached();
  return true;
}

bool EagerProtocol::finish(EagerSendTransfer& send) {
  Op& op = *send.op;
  const bool held =
      send.state == EagerSendState::kHeld || send.state == EagerSendState::kHeldCleared;
  if (held && !fill(send)) return false;
  const std::optional<Status> status = sendCopyOutcome(op);
  if (!status) return false;
  // An unfilled send's op has ended (fill()).
  if (status->ok() && send.state == EagerSendState::kQueued && !op.finished()) {
    moveTo(send, EagerSendState::kLanded);
    --op.outstanding;
    return true;  // its clear-to-send ends it (cleared())
  }
  moveTo(send, EagerSendState::kEnded);
  context_.end(send.op, *status);
  return true;
}

bool EagerProtocol::copyOutOnceFull(EagerRecvTransfer& recv) {
  Op& op = *recv.op;
  const CopyEngineOp& state = copyEngineOp(op);
  bool queued = false;
  if (context_.flags().isSet(recv.ring->full(recv.slot))) {
    try {
      cuda::ContextGuard context(recv.ring->device());
      context_.enqueueCopyOut(op, *recv.ring, recv.slot,
                              context_.copyOutStream(recv.ring->device()));
      queued = true;
    } catch (const Error& error) {
      context_.done(recv.op, Status::failure(StatusCode::kChannel, std::string(reasonOf(error))));
    }
  } else if (!op.finished()) {
    return false;
  }
  // Without a copy out (it failed, or the sender's copy never came and the slot stays full
  // for the lane's end), it ends as one the sender gave up.
  if (!queued) context_.flags().set(state.done.plus(kSenderGaveUp));
  moveTo(recv, queued ? EagerRecvState::kCopyingOut : EagerRecvState::kGivenUp);
  context_.flags().set(state.queued);
  return true;
}

bool EagerProtocol::finish(EagerRecvTransfer& recv) {
  if (recv.state == EagerRecvState::kCallerCopiesOut) {
    EagerRecv& claim = *recv.claim;
    {
      std::lock_guard<std::mutex> lock(claim.mutex);
      // Abandoned: the op failed before its wait() queued the copy out, which never will.
      if (!claim.abandoned && !(claim.queued && claim.copied->reached())) return false;
    }
    moveTo(recv, EagerRecvState::kCallerCopied);
    context_.end(recv.op, Status::success());  // a failed op stays failed
    return true;
  }
  if (recv.state == EagerRecvState::kHeld && !copyOutOnceFull(recv)) return false;
  const std::optional<bool> copied = context_.recvLanded(*recv.op);
  if (!copied) return false;
  moveTo(recv, *copied ? EagerRecvState::kCopied : EagerRecvState::kSenderGaveUp);
  context_.endRecv(recv.op, *copied);
  return true;
}

void EagerProtocol::cancel(const Op& op) {
  // A recv's copy out, once queued, runs; one held ends as its slot fills or the op ends.
  for (auto it = sends_.begin(); it != sends_.end(); ++it) {
    if (it->op.get() != &op) continue;
    if (it->state == EagerSendState::kHeld || it->state == EagerSendState::kHeldCleared) {
      const std::shared_ptr<Op> send = it->op;
      moveTo(*it, EagerSendState::kAbandoned);
      sends_.erase(it);
      context_.end(send, Status::failure(StatusCode::kAborted,
                                         concat(op.describe(), " failed before its eager slot "
                                                "was emptied by its receiver")));
    }
    return;
  }
}

void EagerProtocol::peerFailed(const Peer& peer, const Status& gone) {
  // Queued copies into its (still mapped) slots run; copies out of ours run once the ring's
  // waits are released (StagedProtocol::dropPeer, EagerLanes::dropPeer).
  for (auto it = sends_.begin(); it != sends_.end();) {
    const bool held =
        it->state == EagerSendState::kHeld || it->state == EagerSendState::kHeldCleared;
    if (it->peer != &peer || !held) {
      ++it;
      continue;
    }
    const std::shared_ptr<Op> send = it->op;
    moveTo(*it, EagerSendState::kAbandoned);
    it = sends_.erase(it);
    context_.end(send, gone);  // its copy was never queued
  }
}

std::string EagerProtocol::describeWait(const Op& op) const {
  std::string text;
  for (const EagerSendTransfer& send : sends_) {
    if (send.op.get() != &op) continue;
    text += concat(", eager in slot ", send.slot.slot, " use ", send.slot.use);
    if (send.state == EagerSendState::kHeld || send.state == EagerSendState::kHeldCleared) {
      text += ", held until its receiver empties the slot's use before";
    }
  }
  for (const EagerRecvTransfer& recv : recvs_) {
    if (recv.op.get() != &op || !recv.ring) continue;
    const cuda::Flag full = recv.ring->full(recv.slot);
    text += concat(", staging slot ", recv.slot.slot, " ",
                   flag("full", context_.flags().wordOf(full), full));
  }
  if (op.isSend()) return text;
  if (const auto& eager = copyEngineOp(op).eagerRecv;
      eager && eager->claim == EagerRecv::kByCaller) {
    std::lock_guard<std::mutex> lock(eager->mutex);
    const EagerSlot slot = eagerSlotOf(eager->seq, eager->ring->device());
    const cuda::Flag full = eager->ring->full(slot.staged);
    text += concat(", eager slot ", slot.staged.slot, " use ", slot.staged.use,
                   eager->queued ? ", copy out queued by its wait(), " : ", claimed by its wait(), ",
                   flag("full", context_.flags().wordOf(full), full));
  }
  return text;
}

void EagerProtocol::addStats(std::map<std::string, int64_t>& stats) const {
  stats["eager_lanes"] = lanes_.lanes();
  stats["eager_sends"] = static_cast<int64_t>(eagerSends_.load(std::memory_order_relaxed));
  stats["eager_recvs"] = static_cast<int64_t>(eagerRecvs_);
  stats["eager_recvs_queued_by_wait"] = lanes_.queuedByWait();
  stats["eager_sends_held"] = lanes_.heldSends();
  stats["eager_sends_by_rendezvous"] = lanes_.rendezvousSends();
}

}  // namespace smfree::engine
