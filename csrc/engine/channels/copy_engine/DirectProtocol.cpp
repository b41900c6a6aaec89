#include "engine/channels/copy_engine/DirectProtocol.h"

#include "engine/Error.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/channels/copy_engine/CopyEnginePeer.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

void DirectProtocol::moveTo(DirectSend& send, DirectSendState to) {
  kDirectSendStates.advance(send.state, to, [&] { return send.send.op->describe(); });
}

void DirectProtocol::moveTo(DirectRecv& recv, DirectRecvState to) {
  kDirectRecvStates.advance(recv.state, to, [&] { return recv.op->describe(); });
}

std::string DirectProtocol::exportDestination(const Op& recv, const Peer& source) {
  const Buffer& buffer = recv.request.buffer;
  std::string destination;
  context_.exporter()
      .exportBuffer(buffer.data, buffer.bytes, buffer.device, processKeyOf(source))
      .appendTo(destination);
  return destination;
}

std::string DirectProtocol::arm(const std::shared_ptr<Op>& recv, Peer& source,
                                const std::string& destination, const std::string& ring,
                                const std::string& eager) {
  const CopyEngineOp& state = copyEngineOp(*recv);
  const ClearanceHeader header{state.ready,
                               state.queued,
                               state.done,
                               recv->id,
                               static_cast<uint32_t>(destination.size()),
                               static_cast<uint32_t>(ring.size()),
                               static_cast<uint32_t>(eager.size()),
                               0};
  ++recv->outstanding;
  recvs_.push_back(DirectRecv{recv, &source});
  return toBytes(header) + destination + ring + eager;
}

void DirectProtocol::giveUp(ClearedSend& send) {
  send.peerFlags->set(send.header.queued);
  send.peerFlags->set(send.header.done.plus(kSenderGaveUp));
}

void DirectProtocol::submit(ClearedSend cleared) {
  DirectSend send{std::move(cleared)};
  Op& op = *send.send.op;
  const int device = op.request.buffer.device;
  try {
    cuda::ContextGuard context(device);
    enqueueCopy(send.send, context_.dmaStream(device, send.send.destination.device));
  } catch (const Error&) {
    giveUp(send.send);
    moveTo(send, DirectSendState::kGaveUp);
    throw;
  }
  send.send.peerFlags->set(send.send.header.queued);
  context_.flags().set(copyEngineOp(op).queued);
  ++op.outstanding;
  moveTo(send, DirectSendState::kQueued);
  sends_.push_back(std::move(send));
}

void DirectProtocol::enqueueCopy(const ClearedSend& send, CUstream stream) {
  const Op& op = *send.op;
  const Peer& peer = *send.peer;
  cuda::RemoteFlagSegment& peerFlags = *send.peerFlags;
  const CopyEngineOp& state = copyEngineOp(op);
  // `produced` and the receiver's `ready` were submitted when the ops were posted, before
  // this clearance.
  state.produced->waitOn(stream);
  // A `ready` already set needs no stream wait, which costs this thread about 2 µs per op.
  const cuda::Flag& ready = send.header.ready;
  if (!peerFlags.isSet(ready)) {
    cuda::waitAtLeast(stream, peerFlags.cudaAddress(ready.index), ready.value,
                      "cuStreamWaitValue32 (ready)");
  }
  const int device = op.request.buffer.device;
  const int ownerPidfd = pidfdOf(peer);
  void* destination = context_.ipc().acquire(processKeyOf(peer), ownerPidfd,
                                             send.destination, device, op.request.buffer.bytes);
  try {
    cuda::queueCopy(stream, device, cuda::Place::of(destination, send.destination.device),
                    cuda::Place::of(op.request.buffer.data, device), op.request.buffer.bytes,
                    "cuMemcpyAsync");
    state.copied->record(stream);
    // Last, so that a failure to enqueue it leaves no write of the GPU's behind the
    // kSenderGaveUp that the caller then writes.
    const cuda::Flag copied = send.header.done.plus(kCopied);
    cuda::writeWord(stream, peerFlags.cudaAddress(copied.index), copied.value,
                    "cuStreamWriteValue32 (done)");
  } catch (const Error&) {
    context_.ipc().done(processKeyOf(peer), send.destination, device);
    throw;
  }
}

bool DirectProtocol::progress() {
  const auto finished = [this](auto& transfer) { return finish(transfer); };
  const bool sent = eraseFinished(sends_, finished);
  return eraseFinished(recvs_, finished) || sent;
}

bool DirectProtocol::finish(DirectSend& send) {
  Op& op = *send.send.op;
  const std::optional<Status> status = sendCopyOutcome(op);
  if (!status) return false;
  moveTo(send, status->ok() ? DirectSendState::kLanded : DirectSendState::kFailed);
  context_.ipc().done(processKeyOf(*send.send.peer), send.send.destination,
                      op.request.buffer.device);
  context_.end(send.send.op, *status);
  return true;
}

bool DirectProtocol::finish(DirectRecv& recv) {
  const std::optional<bool> copied = context_.recvLanded(*recv.op);
  if (!copied) return false;
  moveTo(recv, *copied ? DirectRecvState::kCopied : DirectRecvState::kSenderGaveUp);
  context_.endRecv(recv.op, *copied);
  return true;
}

void DirectProtocol::cancel(const Op& op) {
  for (DirectSend& send : sends_) {
    if (send.send.op.get() != &op) continue;
    // A submitted copy cannot be taken back; letting it run keeps no stream parked on a
    // `ready` that may never come (a wedged or dead peer).
    if (send.state == DirectSendState::kQueued) {
      moveTo(send, DirectSendState::kUnparked);
      send.send.peerFlags->set(send.send.header.ready);
    }
    return;
  }
  // A recv's sender may still copy: the buffer stays until its `done` word says how it ended.
}

std::list<DirectRecv>::iterator DirectProtocol::find(const Op& op) {
  for (auto it = recvs_.begin(); it != recvs_.end(); ++it) {
    if (it->op.get() == &op) return it;
  }
  return recvs_.end();
}

void DirectProtocol::partnerGaveUp(const Op& recv) {
  const auto it = find(recv);
  if (it == recvs_.end()) return;
  abandon(*it, Status::failure(StatusCode::kAborted,
                               concat(recv.describe(), " failed: the sender gave up")));
}

void DirectProtocol::peerFailed(const Peer& peer, const Status& gone) {
  for (DirectSend& send : sends_) {
    // Our copy into its (still mapped) memory finishes.
    if (send.send.peer == &peer && send.state == DirectSendState::kQueued) {
      moveTo(send, DirectSendState::kUnparked);
      send.send.peerFlags->set(send.send.header.ready);
    }
  }
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    if (it->peer != &peer) {
      ++it;
      continue;
    }
    // A dead sender's copy will never come.
    const std::shared_ptr<Op> op = it->op;
    moveTo(*it, DirectRecvState::kAbandoned);
    it = recvs_.erase(it);
    context_.end(op, gone);
  }
}

DirectRecv* DirectProtocol::armedRecv(uint64_t recvId) {
  for (DirectRecv& recv : recvs_) {
    if (recv.op->id == recvId) return &recv;
  }
  return nullptr;
}

void DirectProtocol::staged(DirectRecv& recv) {
  moveTo(recv, DirectRecvState::kStaged);
  recvs_.erase(find(*recv.op));
}

void DirectProtocol::abandon(DirectRecv& recv, const Status& status) {
  const std::shared_ptr<Op> op = recv.op;
  moveTo(recv, DirectRecvState::kAbandoned);
  recvs_.erase(find(*op));
  context_.end(op, status);
}

std::string DirectProtocol::describeWait(const Op& op) const {
  for (const DirectSend& send : sends_) {
    if (send.send.op.get() != &op) continue;
    const cuda::Flag& theirs = send.send.header.ready;
    return concat(", peer ready ", theirs.index, ":", send.send.peerFlags->wordOf(theirs), "/",
                  theirs.value);
  }
  return {};
}

}  // namespace smfree::engine
