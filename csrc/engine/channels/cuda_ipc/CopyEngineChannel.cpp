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
  CudaOpState& state = *recv->cuda;
  Clearance clearance{cuda::exportBuffer(recv->request.buffer.data, recv->request.buffer.device),
                      state.ready, state.done, state.moved};
  ++recv->outstanding;
  moving_.push_back(Transfer{recv, &source, std::nullopt});
  return toBytes(clearance);
}

void CopyEngineChannel::startSend(const std::shared_ptr<Op>& send, Peer& destination,
                                  const std::string& channelData) {
  Clearance clearance;
  if (channelData.size() != sizeof(clearance)) {
    fail("malformed clear-to-send for ", send->describe(), " (", channelData.size(), " B)");
  }
  std::memcpy(&clearance, channelData.data(), sizeof(clearance));
  if (!destination.flags) {
    destination.flags = std::make_unique<cuda::RemoteFlagSegment>(destination.address.flagSegment);
  }
  ++send->outstanding;
  waiting_.push_back(Transfer{send, &destination, clearance});
}

bool CopyEngineChannel::progress() {
  bool moved = false;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Transfer& send = *it;
    if (!flags_.isSet(send.op->cuda->ready) || !send.peer->flags->isSet(send.clearance->ready)) {
      ++it;
      continue;
    }
    try {
      enqueueCopy(send);
      moving_.splice(moving_.end(), waiting_, it++);
    } catch (const Error& error) {
      // The receiver is not told; its recv times out. A failed enqueue means a broken context.
      it = abandon(waiting_, it,
                   Status::failure(StatusCode::kTransport,
                                   concat(send.op->describe(), ": ", error.what())));
    }
    moved = true;
  }
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

void CopyEngineChannel::enqueueCopy(Transfer& send) {
  const cuda::Driver& d = cuda::driver();
  Op& op = *send.op;
  const Clearance& clearance = *send.clearance;
  const int device = op.request.buffer.device;
  cuda::ContextGuard context(device);
  void* destination = ipc_.acquire(send.peer->address.processKey, clearance.destination, device);
  CUstream stream = dmaStream(device, clearance.destination.device);
  cuda::check(d.cuMemcpyAsync(address(destination), address(op.request.buffer.data),
                              op.request.buffer.bytes, stream),
              "cuMemcpyAsync");
  // `done` before `moved` on each side: whoever sees `moved` also sees `done`, so `moved`
  // without `done` can only mean a send given up before its copy.
  cuda::RemoteFlagSegment& peerFlags = *send.peer->flags;
  const std::pair<void*, cuda::Flag> writes[] = {
      {peerFlags.cudaAddress(clearance.done.index), clearance.done},
      {peerFlags.cudaAddress(clearance.moved.index), clearance.moved},
      {flags_.cudaAddress(op.cuda->done.index), op.cuda->done},
      {flags_.cudaAddress(op.cuda->moved.index), op.cuda->moved},
  };
  for (const auto& [word, flag] : writes) {
    cuda::check(d.cuStreamWriteValue32(stream, address(word), flag.value,
                                       CU_STREAM_WRITE_VALUE_DEFAULT),
                "cuStreamWriteValue32");
  }
}

bool CopyEngineChannel::finishMove(Transfer& transfer) {
  Op& op = *transfer.op;
  if (!flags_.isSet(op.cuda->moved)) {
    return false;
  }
  --op.outstanding;
  if (op.isSend()) {
    ipc_.done(transfer.peer->address.processKey, transfer.clearance->destination);
    onDone_(transfer.op, Status::success());
  } else if (flags_.isSet(op.cuda->done)) {
    onDone_(transfer.op, Status::success());
  } else {
    flags_.set(op.cuda->done);
    onDone_(transfer.op, Status::failure(StatusCode::kAborted,
                                         concat(op.describe(), " failed: the sender gave up")));
  }
  return true;
}

void CopyEngineChannel::cancel(Op& op) {
  if (!op.isSend()) {
    // The sender may still copy: release the user's streams now, keep the buffer until `moved`.
    flags_.set(op.cuda->done);
    return;
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (it->op.get() != &op) continue;
    if (!it->peer->failed) {
      it->peer->flags->set(it->clearance->moved);  // `moved` without `done`: given up
    }
    abandon(waiting_, it,
            Status::failure(StatusCode::kAborted, concat(op.describe(), " was cancelled")));
    return;
  }
  // An enqueued copy waits for nothing and finishes by itself.
}

std::list<CopyEngineChannel::Transfer>::iterator CopyEngineChannel::abandon(
    std::list<Transfer>& transfers, std::list<Transfer>::iterator it, const Status& status) {
  const std::shared_ptr<Op> op = it->op;
  flags_.set(op->cuda->done);  // no user stream stays parked on it
  --op->outstanding;
  it = transfers.erase(it);
  onDone_(op, status);
  return it;
}

void CopyEngineChannel::peerFailed(Peer& peer) {
  const Status gone = Status::failure(StatusCode::kPeerFailure, peer.failure);
  auto fails = [&](std::list<Transfer>& transfers, bool onlyRecvs) {
    for (auto it = transfers.begin(); it != transfers.end();) {
      if (it->peer != &peer || (onlyRecvs && it->op->isSend())) {
        ++it;
        continue;
      }
      // A dead sender's copy will never come; a send to it was never enqueued.
      it = abandon(transfers, it, gone);
    }
  };
  fails(waiting_, false);
  fails(moving_, true);  // our own enqueued copies into its memory still finish
  ipc_.dropPeer(peer.address.processKey);
}

std::string CopyEngineChannel::describeWait(const Op& op) const {
  auto flag = [](const char* name, uint32_t word, const cuda::Flag& wanted) {
    return concat(name, " ", wanted.index, ":", word, "/", wanted.value);
  };
  const CudaOpState& state = *op.cuda;
  std::string text = concat(flag("ready", flags_.wordOf(state.ready), state.ready), ", ",
                            flag("done", flags_.wordOf(state.done), state.done), ", ",
                            flag("moved", flags_.wordOf(state.moved), state.moved));
  for (const Transfer& send : waiting_) {
    if (send.op.get() == &op) {
      text += concat(", peer ", flag("ready", send.peer->flags->wordOf(send.clearance->ready),
                                     send.clearance->ready));
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
