#include "engine/channels/cuda_ipc/CopyEngineChannel.h"

#include <cstring>
#include <type_traits>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

template <typename T>
std::string toBytes(const T& value) {
  static_assert(std::is_trivially_copyable_v<T>);
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

CUdeviceptr address(void* pointer) { return reinterpret_cast<CUdeviceptr>(pointer); }

}  // namespace

CopyEngineChannel::CopyEngineChannel(cuda::FlagSegment& flags, size_t ipcCacheSize, Done onDone)
    : flags_(flags), ipc_(ipcCacheSize), onDone_(std::move(onDone)) {}

CopyEngineChannel::~CopyEngineChannel() {
  for (auto& [devices, stream] : streams_) {
    cuda::ContextGuard context(devices.first);
    cuda::driver().cuStreamDestroy(stream);
  }
}

std::string CopyEngineChannel::armRecv(const std::shared_ptr<Op>& recv, Peer& source) {
  const CudaOpState& state = *recv->cuda;
  const Buffer& buffer = recv->request.buffer;
  const cuda::IpcExport exported = exporter_.exportBuffer(buffer.data, buffer.bytes,
                                                          buffer.device, source.address.processKey);
  std::string clearance = toBytes(ClearanceFlags{state.ready, state.queued, state.done});
  exported.appendTo(clearance);
  ++recv->outstanding;
  moving_.push_back(Transfer{recv, &source, std::nullopt});
  return clearance;
}

CopyEngineChannel::Clearance CopyEngineChannel::readClearance(const Op& send,
                                                              const std::string& channelData) {
  Clearance clearance;
  if (channelData.size() < sizeof(ClearanceFlags)) {
    fail("malformed clear-to-send for ", send.describe(), " (", channelData.size(), " B)");
  }
  std::memcpy(&clearance.flags, channelData.data(), sizeof(ClearanceFlags));
  clearance.destination = cuda::IpcExport::read(channelData.data() + sizeof(ClearanceFlags),
                                                channelData.size() - sizeof(ClearanceFlags));
  return clearance;
}

void CopyEngineChannel::startSend(const std::shared_ptr<Op>& send, Peer& destination,
                                  const std::string& channelData) {
  const Clearance clearance = readClearance(*send, channelData);
  const ClearanceFlags& theirs = clearance.flags;
  if (!destination.flags) {
    destination.flags = std::make_unique<cuda::RemoteFlagSegment>(destination.address.flagSegment);
  }
  cuda::RemoteFlagSegment& peerFlags = *destination.flags;
  const int device = send->request.buffer.device;
  try {
    cuda::ContextGuard context(device);
    enqueueCopy(*send, destination, clearance, dmaStream(device, clearance.destination.device));
  } catch (const Error&) {
    peerFlags.set(theirs.queued);
    peerFlags.set(theirs.done.plus(kSenderGaveUp));
    throw;
  }
  peerFlags.set(theirs.queued);
  flags_.set(send->cuda->queued);
  ++send->outstanding;
  moving_.push_back(Transfer{send, &destination, clearance});
}

void CopyEngineChannel::enqueueCopy(const Op& send, Peer& peer, const Clearance& clearance,
                                    CUstream stream) {
  const cuda::Driver& d = cuda::driver();
  cuda::RemoteFlagSegment& peerFlags = *peer.flags;
  // `produced` and the receiver's `ready` were submitted when the ops were posted, before
  // this clearance.
  send.cuda->produced->waitOn(stream);
  const cuda::Flag& ready = clearance.flags.ready;
  cuda::check(d.cuStreamWaitValue32(stream, address(peerFlags.cudaAddress(ready.index)),
                                    ready.value, CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue32 (ready)");
  const int device = send.request.buffer.device;
  const int ownerPidfd = peer.watch ? peer.watch->fd() : -1;
  void* destination =
      ipc_.acquire(peer.address.processKey, ownerPidfd, clearance.destination, device);
  try {
    cuda::check(d.cuMemcpyAsync(address(destination), address(send.request.buffer.data),
                                send.request.buffer.bytes, stream),
                "cuMemcpyAsync");
    send.cuda->copied->record(stream);
    // Last, so that a failure to enqueue it leaves no write of the GPU's behind the
    // kSenderGaveUp that the caller then writes.
    const cuda::Flag copied = clearance.flags.done.plus(kCopied);
    cuda::check(d.cuStreamWriteValue32(stream, address(peerFlags.cudaAddress(copied.index)),
                                       copied.value, CU_STREAM_WRITE_VALUE_DEFAULT),
                "cuStreamWriteValue32 (done)");
  } catch (const Error&) {
    ipc_.done(peer.address.processKey, clearance.destination, device);
    throw;
  }
}

bool CopyEngineChannel::progress() {
  bool moved = false;
  for (auto it = moving_.begin(); it != moving_.end();) {
    if (finishMove(*it)) {
      it = moving_.erase(it);
      moved = true;
    } else {
      ++it;
    }
  }
  return moved;
}

bool CopyEngineChannel::finishMove(Transfer& transfer) {
  Op& op = *transfer.op;
  if (op.isSend()) {
    if (!op.cuda->copied->reached()) {
      return false;
    }
    --op.outstanding;
    ipc_.done(transfer.peer->address.processKey, transfer.clearance->destination,
              op.request.buffer.device);
    onDone_(transfer.op, Status::success());
    return true;
  }
  // A recv also waits for `queued`: the sender's CPU writes it, and nothing may write the
  // word once it is handed to another op.
  const cuda::Flag& done = op.cuda->done;
  if (!flags_.isSet(done.plus(kCopied)) || !flags_.isSet(op.cuda->queued)) {
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
  if (!op.isSend()) {
    return;  // the sender may still copy: the buffer stays until its `done` word says how it ended
  }
  for (Transfer& send : moving_) {
    if (send.op.get() == &op) {
      releaseReadiness(send);
      return;
    }
  }
}

void CopyEngineChannel::partnerGaveUp(Op& op) {
  for (auto it = moving_.begin(); it != moving_.end(); ++it) {
    if (it->op.get() == &op) {
      abandon(it, Status::failure(StatusCode::kAborted,
                                  concat(op.describe(), " failed: the sender gave up")));
      return;
    }
  }
}

void CopyEngineChannel::releaseReadiness(Transfer& send) {
  // A submitted copy cannot be taken back; letting it run keeps no stream parked on a
  // `ready` that may never come (a wedged or dead peer).
  send.peer->flags->set(send.clearance->flags.ready);
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
  for (auto it = moving_.begin(); it != moving_.end();) {
    if (it->peer != &peer) {
      ++it;
    } else if (it->op->isSend()) {
      releaseReadiness(*it);  // our copy into its (still mapped) memory finishes by itself
      ++it;
    } else {
      it = abandon(it, gone);  // a dead sender's copy will never come
    }
  }
  ipc_.dropPeer(peer.address.processKey);
}

std::string CopyEngineChannel::describeWait(const Op& op) const {
  auto flag = [](const char* name, uint32_t word, const cuda::Flag& wanted) {
    return concat(name, " ", wanted.index, ":", word, "/", wanted.value);
  };
  const CudaOpState& state = *op.cuda;
  std::string text = flag("queued", flags_.wordOf(state.queued), state.queued);
  if (!op.isSend()) {
    return concat(text, ", ", flag("ready", flags_.wordOf(state.ready), state.ready), ", ",
                  flag("done", flags_.wordOf(state.done), state.done.plus(kCopied)));
  }
  auto event = [](const char* name, const std::shared_ptr<cuda::Event>& e) {
    return concat(name, " ", e && e->reached() ? "reached" : "pending");
  };
  text += concat(", ", event("produced", state.produced), ", ", event("copied", state.copied));
  for (const Transfer& send : moving_) {
    if (send.op.get() == &op && send.clearance) {
      const cuda::Flag& theirs = send.clearance->flags.ready;
      text += concat(", peer ", flag("ready", send.peer->flags->wordOf(theirs), theirs));
    }
  }
  return text;
}

CUstream CopyEngineChannel::dmaStream(int localDevice, int peerDevice) {
  auto& stream = streams_[{localDevice, peerDevice}];
  if (!stream) {
    cuda::check(cuda::driver().cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    log(LogLevel::kInfo, "DMA stream for cuda:", localDevice, " -> peer cuda:", peerDevice);
  }
  return stream;
}

}  // namespace smfree::engine
