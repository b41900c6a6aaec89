#include "engine/channels/copy_engine/StagedProtocol.h"

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/channels/copy_engine/CopyEnginePeer.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

void StagedProtocol::moveTo(StagedSend& send, StagedSendState to) {
  kStagedSendStates.advance(send.state, to, [&] { return send.send.op->describe(); });
}

void StagedProtocol::moveTo(StagedRecv& recv, StagedRecvState to) {
  kStagedRecvStates.advance(recv.state, to, [&] { return recv.op->describe(); });
}

bool StagedProtocol::stageable(uint64_t bytes) const {
  return bytes >= kStagingMinBytes && bytes <= stagingBytes_;
}

std::shared_ptr<StagingRing> StagedProtocol::ringFor(const Peer& source, int device) {
  auto [it, created] = rings_.try_emplace(RingKey{processKeyOf(source), device});
  if (created) {
    try {
      it->second = std::make_shared<StagingRing>(
          context_.flags(), context_.ringMemory(), device, stagingBytes_, kStagingSlots, false,
          concat("staging ring of ", kStagingSlots, " x ", stagingBytes_, " B for sends from ",
                 describePeer(source)));
    } catch (const Error& error) {
      RingMemory::refused(concat("no staging ring on cuda:", device, " for sends from ",
                                 describePeer(source), " (", reasonOf(error),
                                 "): they wait for this process's streams"));
    }
  }
  return it->second;
}

std::string StagedProtocol::ringData(const Peer& source, const Op& recv) {
  std::string ring;
  const Buffer& buffer = recv.request.buffer;
  if (stageable(buffer.bytes)) {
    if (const auto staging = ringFor(source, buffer.device)) staging->appendTo(ring);
  }
  return ring;
}

void StagedProtocol::learn(const Peer& destination, std::shared_ptr<RemoteStagingRing> ring) {
  if (!ring) return;
  auto& known = remoteRings_[RingKey{processKeyOf(destination), ring->device()}];
  if (!known || known->bufferId() != ring->bufferId()) known = std::move(ring);
}

void StagedProtocol::start(ClearedSend cleared) {
  StagedSend send{std::move(cleared), nullptr, std::nullopt};
  Op& op = *send.send.op;
  const uint64_t bytes = op.request.buffer.bytes;
  if (stageable(bytes)) {
    auto ring = remoteRings_.find(
        RingKey{processKeyOf(*send.send.peer), send.send.destination.device});
    if (ring != remoteRings_.end() && ring->second->slotBytes() >= bytes) {
      send.remote = ring->second;
    }
  }
  if (!send.remote || send.send.peerFlags->isSet(send.send.header.ready)) {
    direct_.submit(std::move(send.send));
    return;
  }
  ++op.outstanding;
  held_.push_back(std::move(send));
  advanceHeld();
}

void StagedProtocol::submit(StagedSend send, const StagedSlot& slot) {
  Op& op = *send.send.op;
  const int device = op.request.buffer.device;
  try {
    cuda::ContextGuard context(device);
    enqueueStagedCopy(send, slot, context_.dmaStream(device, send.remote->device()));
  } catch (const Error&) {
    DirectProtocol::giveUp(send.send);
    moveTo(send, StagedSendState::kFailed);
    throw;
  }
  send.remote->take(slot);
  send.slot = slot;
  // The receiver's `queued` is its own to set, once it has submitted the copy out.
  context_.notify(*send.send.peer,
                  toBytes(StagedNotice{send.send.header.recvId, send.remote->device(), slot.slot,
                                       slot.use, 0}));
  context_.flags().set(copyEngineOp(op).queued);
  ++op.outstanding;
  ++stagedSends_;
  moveTo(send, StagedSendState::kQueued);
  sends_.push_back(std::move(send));
}

void StagedProtocol::enqueueStagedCopy(StagedSend& send, const StagedSlot& slot,
                                       CUstream stream) {
  const Op& op = *send.send.op;
  const CopyEngineOp& state = copyEngineOp(op);
  // `produced` was submitted when the send was posted; the slot is empty (nextFree()).
  state.produced->waitOn(stream);
  const CUdeviceptr to = send.remote->slotAddress(slot, op.request.buffer.device);
  cuda::queueCopy(stream, op.request.buffer.device, {to, send.remote->device()},
                  cuda::Place::of(op.request.buffer.data, op.request.buffer.device),
                  op.request.buffer.bytes, "cuMemcpyAsync (to a staging slot)");
  state.copied->record(stream);
  const cuda::Flag full = send.remote->full(slot);
  cuda::writeWord(stream, send.send.peerFlags->cudaAddress(full.index), full.value,
                  "cuStreamWriteValue32 (staging slot full)");
}

void StagedProtocol::onNotice(Peer& source, const std::string& data) {
  const StagedNotice notice = readStagedNotice(data);
  const auto ringIt = rings_.find(RingKey{processKeyOf(source), notice.ringDevice});
  if (ringIt == rings_.end() || !ringIt->second || notice.slot >= ringIt->second->slots()) {
    log(LogLevel::kError, "ignored a staging notice from ", describePeer(source),
        " for a slot this process does not have (cuda:", notice.ringDevice, " slot ",
        notice.slot, ")");
    return;
  }
  StagingRing& ring = *ringIt->second;
  const StagedSlot slot{notice.slot, notice.use};
  DirectRecv* recv = direct_.armedRecv(notice.recvId);
  try {
    cuda::ContextGuard context(ring.device());
    const CUstream stream = context_.copyOutStream(ring.device());
    if (!recv) {
      context_.enqueueEmptying(ring, slot, stream);  // the recv is gone; the slot comes back
      return;
    }
    context_.enqueueCopyOut(*recv->op, ring, slot, stream);
  } catch (const Error& error) {
    if (recv) {
      direct_.abandon(*recv, Status::failure(StatusCode::kChannel, error.what()));
    } else {
      log(LogLevel::kError, "a staging slot from ", describePeer(source), " is lost: ",
          error.what());
    }
    return;
  }
  StagedRecv staged{recv->op, ringIt->second, slot};
  direct_.staged(*recv);
  ++stagedRecvs_;
  context_.flags().set(copyEngineOp(*staged.op).queued);
  recvs_.push_back(std::move(staged));
}

bool StagedProtocol::advanceHeld() {
  bool advanced = false;
  for (auto it = held_.begin(); it != held_.end();) {
    const bool ready = it->send.peerFlags->isSet(it->send.header.ready);
    std::optional<StagedSlot> slot;
    if (!ready) slot = it->remote->nextFree(*it->send.peerFlags);
    if (!ready && !slot) {
      ++it;
      continue;
    }
    StagedSend send = std::move(*it);
    it = held_.erase(it);
    --send.send.op->outstanding;
    const std::shared_ptr<Op> op = send.send.op;
    try {
      if (slot) {
        submit(std::move(send), *slot);
      } else {
        moveTo(send, StagedSendState::kDirect);
        direct_.submit(std::move(send.send));
      }
    } catch (const Error& error) {
      context_.done(op, Status::failure(StatusCode::kChannel, error.what()));
    }
    advanced = true;
  }
  return advanced;
}

bool StagedProtocol::finish(StagedSend& send) {
  const std::optional<Status> status = sendCopyOutcome(*send.send.op);
  if (!status) return false;
  moveTo(send, status->ok() ? StagedSendState::kLanded : StagedSendState::kFailed);
  context_.end(send.send.op, *status);
  return true;
}

bool StagedProtocol::progress() {
  bool moved = eraseFinished(sends_, [this](auto& transfer) { return finish(transfer); });
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    const std::optional<bool> copied = context_.recvLanded(*it->op);
    if (!copied) {
      ++it;
      continue;
    }
    moveTo(*it, *copied ? StagedRecvState::kCopied : StagedRecvState::kSenderGaveUp);
    const std::shared_ptr<Op> op = it->op;
    it = recvs_.erase(it);
    context_.endRecv(op, *copied);
    moved = true;
  }
  return moved;
}

void StagedProtocol::cancel(const Op& op) {
  // A queued copy into a slot waits for nothing of the receiver's: it runs on.
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (it->send.op.get() != &op) continue;
    StagedSend send = std::move(*it);
    held_.erase(it);
    DirectProtocol::giveUp(send.send);
    moveTo(send, StagedSendState::kCancelled);
    context_.end(send.send.op, Status::failure(StatusCode::kAborted,
                                               concat(op.describe(), " failed before its copy")));
    return;
  }
}

void StagedProtocol::peerFailed(const Peer& peer, const Status& gone) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->send.peer != &peer) {
      ++it;
      continue;
    }
    const std::shared_ptr<Op> op = it->send.op;
    moveTo(*it, StagedSendState::kPeerFailed);
    it = held_.erase(it);
    context_.end(op, gone);
  }
}

void StagedProtocol::dropPeer(const std::string& processKey) {
  for (auto it = rings_.begin(); it != rings_.end();) {
    if (it->first.first != processKey) {
      ++it;
      continue;
    }
    if (it->second) it->second->releaseWaits();
    it = rings_.erase(it);  // recvs still copying out hold it
  }
  for (auto it = remoteRings_.begin(); it != remoteRings_.end();) {
    it = it->first.first == processKey ? remoteRings_.erase(it) : std::next(it);
  }
}

std::string StagedProtocol::describeWait(const Op& op) const {
  auto flag = [](const char* name, uint32_t word, const cuda::Flag& wanted) {
    return concat(name, " ", wanted.index, ":", word, "/", wanted.value);
  };
  for (const StagedSend& send : held_) {
    if (send.send.op.get() != &op) continue;
    const cuda::Flag& theirs = send.send.header.ready;
    return concat(", held for a staging slot or peer ",
                  flag("ready", send.send.peerFlags->wordOf(theirs), theirs));
  }
  for (const StagedSend& send : sends_) {
    if (send.send.op.get() == &op) {
      return concat(", staged in slot ", send.slot->slot, " use ", send.slot->use);
    }
  }
  for (const StagedRecv& recv : recvs_) {
    if (recv.op.get() != &op) continue;
    const cuda::Flag full = recv.ring->full(recv.slot);
    return concat(", staging slot ", recv.slot.slot, " ",
                  flag("full", context_.flags().wordOf(full), full));
  }
  return {};
}

void StagedProtocol::addStats(std::map<std::string, int64_t>& stats) const {
  stats["staging_rings"] = static_cast<int64_t>(rings_.size());
  stats["staged_sends"] = static_cast<int64_t>(stagedSends_);
  stats["staged_recvs"] = static_cast<int64_t>(stagedRecvs_);
}

}  // namespace smfree::engine
