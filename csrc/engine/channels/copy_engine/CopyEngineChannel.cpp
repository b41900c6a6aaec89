#include "engine/channels/copy_engine/CopyEngineChannel.h"

#include <cstring>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/PeerValue.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

CopyEngineChannel::CopyEngineChannel(CudaOps& cudaOps, const ProgressThread& thread,
                                     std::string processKey, size_t ipcCacheSize,
                                     uint64_t stagingBytes, uint64_t eagerBytes,
                                     uint64_t ringMemoryBytes, bool collectiveLanes, Done onDone,
                                     Notify notify, Release release)
    : Channel({Capability::kNotices, Capability::kProgress, Capability::kSweep,
               Capability::kSameHostOnly}),
      cudaOps_(cudaOps),
      thread_(thread),
      flags_(cudaOps.flags()),
      ipc_(ipcCacheSize),
      stagingBytes_(stagingBytes),
      ringMemory_(ringMemoryBytes),
      onDone_(std::move(onDone)),
      notify_(std::move(notify)),
      release_(std::move(release)),
      lanes_(cudaOps.flags(), ringMemory_, eagerBytes),
      collectiveLanes_(cudaOps.flags(), std::move(processKey), ipcCacheSize,
              [this](const std::string& key, const PeerAddress& address,
                     int ownerPidfd) -> cuda::RemoteFlagSegment& {
                return flagsOf(key, address, ownerPidfd);
              }),
      lanesForCollectives_(collectiveLanes) {}

cuda::RemoteFlagSegment& CopyEngineChannel::flagsOf(const Peer& peer) {
  return flagsOf(peer.address.processKey, peer.address, peer.watch ? peer.watch->fd() : -1);
}

cuda::RemoteFlagSegment& CopyEngineChannel::flagsOf(const std::string& key,
                                                    const PeerAddress& address, int ownerPidfd) {
  std::lock_guard<std::mutex> lock(peerFlagsMutex_);
  auto& flags = peerFlags_[key];
  if (!flags) {
    flags = std::make_unique<cuda::RemoteFlagSegment>(
        ownerPidfd, address.flagSegment, address.describe());
  }
  return *flags;
}

std::string CopyEngineChannel::armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                                       const std::string& announced) {
  thread_.check("CopyEngineChannel::armRecv");
  if (!announced.empty()) return armEager(recv, source, announced);
  const CopyEngineOp& state = copyEngineOp(*recv);
  if (state.collective) {
    moveCollective(recv, &source);
    return {};  // its sender's op knows from its record: the copy is queued
  }
  if (state.eagerRecv && !state.eagerRecv->claimBy(EagerRecv::kByProgress)) {
    fail(recv->describe(), " expected its message in an eager slot, and its sender sent it by "
         "rendezvous (the two sides' sizes differ)");
  }
  const Buffer& buffer = recv->request.buffer;
  std::string destination;
  exporter_.exportBuffer(buffer.data, buffer.bytes, buffer.device, source.address.processKey)
      .appendTo(destination);
  std::string ring;
  if (stageable(buffer.bytes)) {
    if (const auto staging = ringFor(source, buffer.device)) staging->appendTo(ring);
  }
  // A send that could have gone eagerly did not: its sender may not know the ring yet.
  std::string eager;
  if (buffer.bytes <= lanes_.slotBytes()) {
    const auto ring = lanes_.ringFor(laneOf(*recv, source.address.processKey), buffer.device);
    if (ring) ring->appendTo(eager);
  }
  const ClearanceHeader header{state.ready,
                               state.queued,
                               state.done,
                               recv->id,
                               static_cast<uint32_t>(destination.size()),
                               static_cast<uint32_t>(ring.size()),
                               static_cast<uint32_t>(eager.size()),
                               0};
  ++recv->outstanding;
  moving_.push_back(
      Transfer{.op = recv, .peer = &source});
  return toBytes(header) + destination + ring + eager;
}

CopyEngineChannel::Clearance CopyEngineChannel::takeClearance(const Op& send, Peer& destination,
                                                              const std::string& channelData) {
  ClearanceData read = readClearance(channelData);
  if (read.ring) {
    auto& known = remoteRings_[RingKey{destination.address.processKey, read.ring->device()}];
    if (!known || known->bufferId() != read.ring->bufferId()) known = std::move(read.ring);
  }
  if (read.eagerRing) {
    cuda::ContextGuard context(send.request.buffer.device);  // open() registers the words
    lanes_.open(laneOf(send, destination.address.processKey), std::move(read.eagerRing),
                flagsOf(destination));
  }
  return Clearance{read.header, std::move(read.destination)};
}

void CopyEngineChannel::startSend(const std::shared_ptr<Op>& send, Peer& destination,
                                  const std::string& channelData) {
  thread_.check("CopyEngineChannel::startSend");
  if (copyEngineOp(*send).eager) {
    clearedEager(send);  // its bytes are in the receiver's slot, and the receiver took them
    return;
  }
  if (copyEngineOp(*send).collective) {
    if (!channelData.empty()) {
      fail(send->describe(), " went by a collective lane and its receiver cleared it by "
           "rendezvous (SMFREE_COLLECTIVE_LANES must be alike on every rank)");
    }
    moveCollective(send, &destination);
    return;
  }
  if (send->isCollective() && channelData.empty()) {
    fail(send->describe(), " went by rendezvous and its receiver's piece by a collective lane "
         "(SMFREE_COLLECTIVE_LANES must be alike on every rank)");
  }
  Transfer transfer{.op = send,
                    .peer = &destination,
                    .clearance = takeClearance(*send, destination, channelData)};
  transfer.peerFlags = &flagsOf(destination);
  const uint64_t bytes = send->request.buffer.bytes;
  if (stageable(bytes)) {
    auto ring = remoteRings_.find(
        RingKey{destination.address.processKey, transfer.clearance->destination.device});
    if (ring != remoteRings_.end() && ring->second->slotBytes() >= bytes) {
      transfer.remote = ring->second;
    }
  }
  if (transfer.remote && !transfer.peerFlags->isSet(transfer.clearance->header.ready)) {
    ++send->outstanding;
    held_.push_back(std::move(transfer));
    advanceHeld();
    return;
  }
  submitDirect(std::move(transfer));
}

void CopyEngineChannel::giveUp(Transfer& send) {
  const ClearanceHeader& theirs = send.clearance->header;
  send.peerFlags->set(theirs.queued);
  send.peerFlags->set(theirs.done.plus(kSenderGaveUp));
}

void CopyEngineChannel::submitDirect(Transfer send) {
  Op& op = *send.op;
  const int device = op.request.buffer.device;
  try {
    cuda::ContextGuard context(device);
    enqueueCopy(send, dmaStream(device, send.clearance->destination.device));
  } catch (const Error&) {
    giveUp(send);
    throw;
  }
  send.peerFlags->set(send.clearance->header.queued);
  flags_.set(copyEngineOp(op).queued);
  ++op.outstanding;
  send.remote.reset();
  moving_.push_back(std::move(send));
}

void CopyEngineChannel::enqueueCopy(const Transfer& transfer, CUstream stream) {
  const Op& send = *transfer.op;
  const Peer& peer = *transfer.peer;
  const Clearance& clearance = *transfer.clearance;
  cuda::RemoteFlagSegment& peerFlags = *transfer.peerFlags;
  const CopyEngineOp& state = copyEngineOp(send);
  // `produced` and the receiver's `ready` were submitted when the ops were posted, before
  // this clearance.
  state.produced->waitOn(stream);
  // A `ready` already set needs no stream wait, which costs this thread about 2 µs per op.
  const cuda::Flag& ready = clearance.header.ready;
  if (!peerFlags.isSet(ready)) {
    cuda::waitAtLeast(stream, peerFlags.cudaAddress(ready.index), ready.value,
                      "cuStreamWaitValue32 (ready)");
  }
  const int device = send.request.buffer.device;
  const int ownerPidfd = peer.watch ? peer.watch->fd() : -1;
  void* destination =
      ipc_.acquire(peer.address.processKey, ownerPidfd, clearance.destination, device,
                   send.request.buffer.bytes);
  try {
    cuda::queueCopy(stream, device, cuda::Place::of(destination, clearance.destination.device),
                    cuda::Place::of(send.request.buffer.data, device), send.request.buffer.bytes,
                    "cuMemcpyAsync");
    state.copied->record(stream);
    // Last, so that a failure to enqueue it leaves no write of the GPU's behind the
    // kSenderGaveUp that the caller then writes.
    const cuda::Flag copied = clearance.header.done.plus(kCopied);
    cuda::writeWord(stream, peerFlags.cudaAddress(copied.index), copied.value,
                    "cuStreamWriteValue32 (done)");
  } catch (const Error&) {
    ipc_.done(peer.address.processKey, clearance.destination, device);
    throw;
  }
}

Progress CopyEngineChannel::progress() {
  thread_.check("CopyEngineChannel::progress");
  bool moved = advanceHeld();
  moved = emptyHeldSlots() || moved;
  for (auto it = moving_.begin(); it != moving_.end();) {
    if (finishMove(*it)) {
      it = moving_.erase(it);
      moved = true;
    } else {
      ++it;
    }
  }
  return Progress{moved};
}

bool CopyEngineChannel::finishMove(Transfer& transfer) {
  Op& op = *transfer.op;
  const CopyEngineOp& state = copyEngineOp(op);
  if (transfer.held && !(op.isSend() ? fillHeld(transfer) : copyOutOnceFull(transfer))) {
    return false;
  }
  if (transfer.collective) return finishCollective(transfer);
  if (op.isSend()) {
    Status status = Status::success();
    try {
      if (!state.copied->reached()) return false;
      // The DMA stream waited for `produced` before the copy that `copied` follows.
      state.produced->markReached();
    } catch (const Error& error) {
      // The device failed (a sticky CUDA error): the copy will not run.
      status = Status::failure(StatusCode::kTransport,
                               concat(op.describe(), " failed: ", reasonOf(error)));
    }
    --op.outstanding;
    if (status.ok() && transfer.eager && !transfer.cleared && !op.finished()) {
      return true;  // its clear-to-send ends it (clearedEager)
    }
    if (!transfer.slot) {
      ipc_.done(transfer.peer->address.processKey, transfer.clearance->destination,
                op.request.buffer.device);
    }
    onDone_(transfer.op, status);
    return true;
  }
  if (transfer.callerCopiesOut) return finishCallersCopyOut(transfer);
  // A recv also waits for `queued`: the sender's CPU writes it, and nothing may write the
  // word once it is handed to another op.
  const cuda::Flag& done = state.done;
  if (!flags_.isSet(done.plus(kCopied)) || !flags_.isSet(state.queued)) {
    return false;
  }
  --op.outstanding;
  if (flags_.wordOf(done) == done.value + kCopied) {
    onDone_(transfer.op, Status::success());
  } else {
    onDone_(transfer.op, Status::failure(StatusCode::kAborted,
                                         concat(op.describe(), " failed: the sender gave up")));
  }
  return true;
}

void CopyEngineChannel::cancel(Op& op) {
  thread_.check("CopyEngineChannel::cancel");
  if (const auto& piece = copyEngineOp(op).collective) {
    // A queued copy cannot be taken back; the op ends once it ran. Ours must not stay parked on
    // a wedged peer's stream.
    if (piece->role == CollectiveRole::kSecond) CollectiveLanes::release(*piece);
    return;
  }
  if (!op.isSend()) {
    return;  // the sender may still copy: the buffer stays until its `done` word says how it ended
  }
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (it->op.get() == &op) {
      Transfer send = std::move(*it);
      held_.erase(it);
      giveUp(send);
      --op.outstanding;
      onDone_(send.op, Status::failure(StatusCode::kAborted,
                                       concat(op.describe(), " failed before its copy")));
      return;
    }
  }
  for (auto it = moving_.begin(); it != moving_.end(); ++it) {
    if (it->op.get() != &op) continue;
    if (it->held) {
      abandon(it, Status::failure(StatusCode::kAborted,
                                  concat(op.describe(), " failed before its eager slot was "
                                         "emptied by its receiver")));
    } else if (!it->slot) {
      releaseReadiness(*it);  // a staged copy waits for nothing of the receiver's
    }
    return;
  }
}

void CopyEngineChannel::partnerGaveUp(Op& op) {
  if (copyEngineOp(op).collective) return;  // the copy was queued at a post: it ends as it runs
  for (auto it = moving_.begin(); it != moving_.end(); ++it) {
    if (it->op.get() == &op) {
      // A submitted copy out of a slot still writes the buffer: it ends as it finishes.
      if (!it->slot && !it->callerCopiesOut) {
        abandon(it, Status::failure(StatusCode::kAborted,
                                    concat(op.describe(), " failed: the sender gave up")));
      }
      return;
    }
  }
}

void CopyEngineChannel::releaseReadiness(Transfer& send) {
  // A submitted copy cannot be taken back; letting it run keeps no stream parked on a
  // `ready` that may never come (a wedged or dead peer).
  send.peerFlags->set(send.clearance->header.ready);
}

std::list<CopyEngineChannel::Transfer>::iterator CopyEngineChannel::abandon(
    std::list<Transfer>::iterator it, const Status& status) {
  const std::shared_ptr<Op> op = it->op;
  --op->outstanding;
  it = moving_.erase(it);
  onDone_(op, status);
  return it;
}

void CopyEngineChannel::peerFailed(Peer& peer) {
  const Status gone = Status::failure(StatusCode::kPeerFailure, peer.failure);
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->peer != &peer) {
      ++it;
      continue;
    }
    const std::shared_ptr<Op> op = it->op;
    --op->outstanding;
    it = held_.erase(it);
    onDone_(op, gone);
  }
  peerFailedCollective(peer);
  for (auto it = moving_.begin(); it != moving_.end();) {
    if (it->peer != &peer || it->collective) {
      ++it;
    } else if (it->op->isSend() && it->held) {
      it = abandon(it, gone);  // its copy was never queued
    } else if (it->op->isSend()) {
      if (!it->slot) releaseReadiness(*it);  // our copy into its (still mapped) memory finishes
      ++it;
    } else if (it->slot || it->callerCopiesOut) {
      ++it;  // its copy out of the slot runs once the ring's waits are released below
    } else {
      it = abandon(it, gone);  // a dead sender's copy will never come
    }
  }
  const std::string& key = peer.address.processKey;
  for (auto it = rings_.begin(); it != rings_.end();) {
    if (it->first.first != key) {
      ++it;
      continue;
    }
    if (it->second) it->second->releaseWaits();
    it = rings_.erase(it);  // recvs still copying out hold it
  }
  for (auto it = remoteRings_.begin(); it != remoteRings_.end();) {
    it = it->first.first == key ? remoteRings_.erase(it) : std::next(it);
  }
  lanes_.dropPeer(key);
  ipc_.dropPeer(key);
}

std::string CopyEngineChannel::describeWait(const Op& op) const {
  auto flag = [](const char* name, uint32_t word, const cuda::Flag& wanted) {
    return concat(name, " ", wanted.index, ":", word, "/", wanted.value);
  };
  const CopyEngineOp& state = copyEngineOp(op);
  std::string text = flag("queued", flags_.wordOf(state.queued), state.queued);
  if (const auto& piece = state.collective) {
    const bool first = piece->role == CollectiveRole::kFirst;
    return concat(text, ", collective lane, ", first ? "posted first" : "copy queued at its post",
                  ", ", flag("done", flags_.wordOf(state.done), state.done.plus(kCopied)));
  }
  if (!op.isSend()) {
    text += concat(", ", flag("ready", flags_.wordOf(state.ready), state.ready), ", ",
                   flag("done", flags_.wordOf(state.done), state.done.plus(kCopied)));
    for (const Transfer& recv : moving_) {
      if (recv.op.get() == &op && recv.slot) {
        const cuda::Flag full = recv.ring->full(*recv.slot);
        text += concat(", staging slot ", recv.slot->slot, " ",
                       flag("full", flags_.wordOf(full), full));
      }
    }
    if (const auto& eager = state.eagerRecv; eager && eager->claim == EagerRecv::kByCaller) {
      std::lock_guard<std::mutex> lock(eager->mutex);
      const EagerSlot slot = eagerSlotOf(eager->seq, eager->ring->device());
      const cuda::Flag full = eager->ring->full(slot.staged);
      text += concat(", eager slot ", slot.staged.slot, " use ", slot.staged.use,
                     eager->queued ? ", copy out queued by its wait(), " : ", claimed by its wait(), ",
                     flag("full", flags_.wordOf(full), full));
    }
    return text;
  }
  auto event = [](const char* name, const std::shared_ptr<cuda::Event>& e) {
    return concat(name, " ", e && e->reached() ? "reached" : "pending");
  };
  text += concat(", ", event("produced", state.produced), ", ", event("copied", state.copied));
  for (const Transfer& send : held_) {
    if (send.op.get() == &op) {
      const cuda::Flag& theirs = send.clearance->header.ready;
      text += concat(", held for a staging slot or peer ",
                     flag("ready", send.peerFlags->wordOf(theirs), theirs));
    }
  }
  for (const Transfer& send : moving_) {
    if (send.op.get() == &op && send.slot) {
      text += concat(send.eager ? ", eager in slot " : ", staged in slot ", send.slot->slot,
                     " use ", send.slot->use);
      if (send.held) text += ", held until its receiver empties the slot's use before";
    } else if (send.op.get() == &op) {
      const cuda::Flag& theirs = send.clearance->header.ready;
      text += concat(", peer ", flag("ready", send.peerFlags->wordOf(theirs), theirs));
    }
  }
  return text;
}

void CopyEngineChannel::sweep() {
  for (auto& [key, ids] : exporter_.sweep()) release_(key, std::move(ids));
  for (auto& [key, ids] : collectiveLanes_.sweep()) release_(key, std::move(ids));
}

void CopyEngineChannel::onNotice(const Notice& notice) {
  if (const auto* n = std::get_if<PeerNotice>(&notice)) {
    onNotice(n->source, n->data);
  } else if (const auto* n = std::get_if<SendAnnounced>(&notice)) {
    announced(n->source, n->rts);
  } else if (const auto* n = std::get_if<SendUnarmed>(&notice)) {
    discard(n->source, n->rts, n->recv);
  } else if (const auto* n = std::get_if<MemoryFreed>(&notice)) {
    onMemoryReleased(n->owner, n->ids);
  }
}

void CopyEngineChannel::report(ChannelReport& report) const {
  if (ringMemory_.taken() != 0) {
    report.memory.push_back(concat("rings for peers' sends: ", ringMemory_.describe()));
  }
  std::map<std::string, int64_t>& stats = report.stats;
  stats["ipc_mappings"] = static_cast<int64_t>(ipc_.size());
  stats["ipc_exports"] = static_cast<int64_t>(exporter_.size());
  stats["staging_rings"] = static_cast<int64_t>(rings_.size());
  stats["staged_sends"] = static_cast<int64_t>(stagedSends_);
  stats["staged_recvs"] = static_cast<int64_t>(stagedRecvs_);
  stats["eager_lanes"] = lanes_.lanes();
  stats["eager_sends"] = static_cast<int64_t>(eagerSends_.load(std::memory_order_relaxed));
  stats["eager_recvs"] = static_cast<int64_t>(eagerRecvs_);
  stats["eager_recvs_queued_by_wait"] = lanes_.queuedByWait();
  stats["eager_sends_held"] = lanes_.heldSends();
  stats["eager_sends_by_rendezvous"] = lanes_.rendezvousSends();
  stats["ring_bytes"] = static_cast<int64_t>(ringMemory_.taken());
  collectiveLanes_.addStats(stats);
}

CUstream CopyEngineChannel::dmaStream(int localDevice, int peerDevice) {
  auto& stream = streams_[{localDevice, peerDevice}];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(localDevice, cuda::Stream::OnDestroy::kRelease);
    log(LogLevel::kInfo, "DMA stream for cuda:", localDevice, " -> peer cuda:", peerDevice);
  }
  return stream->handle();
}

CUstream CopyEngineChannel::copyOutStream(int device) {
  auto& stream = copyOutStreams_[device];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(device, cuda::Stream::OnDestroy::kRelease);
    log(LogLevel::kInfo, "staging copy-out stream for cuda:", device);
  }
  return stream->handle();
}

}  // namespace smfree::engine
