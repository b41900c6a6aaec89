// The captured ops' work on the caller's thread: the nodes a send puts in its graph at its
// post, those a recv puts there at its wait(), and the joins of the caller's stream.
#include "engine/channels/captured/CapturedChannel.h"

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {
namespace {

// Queues on `chain`: wait until `word` is 1, then take it (0), the wait bracketed by the op's
// watched word so that a fault can release it (GraphWait).
void takeWord(CUstream chain, void* waiting, void* word, const char* what) {
  cuda::runInOrder(chain,
                   {{cuda::WordOp::kWrite, waiting, GraphWait::kWaiting},
                    {cuda::WordOp::kWaitEquals, word, 1},
                    {cuda::WordOp::kWrite, word, 0},
                    {cuda::WordOp::kWrite, waiting, GraphWait::kIdle}},
                   what);
}

}  // namespace

std::shared_ptr<ChannelOp> CapturedChannel::prepare(Op& op, const PostOptions& options) {
  const cuda::Capture& capture = *op.request.capture;
  auto captured = std::make_shared<CapturedOp>();
  captured->isSend = op.isSend();
  captured->what = op.describe();
  captured->groupId = op.groupId;
  captured->peerKey = options.peerKey;
  captured->peerRank = op.request.peer;
  captured->captureId = capture.id;
  captured->buffer = op.request.buffer;
  captured->keepalive = op.request.keepalive;
  captured->timeout = options.timeout;
  if (captured->buffer.bytes != 0) {
    const int device = captured->buffer.device;
    cuda::ContextGuard context(device);
    captured->waiting = std::make_unique<cuda::OwnedFlag>(flags_);
    flags_.store(captured->waiting->get(), GraphWait::kIdle);
    captured->watch.emplace(flags_.word(captured->waiting->get()));
    captured->posted = std::make_shared<cuda::Event>(device);
    captured->done = std::make_unique<cuda::Event>(device);
    const auto stream = static_cast<CUstream>(op.request.stream);
    if (captured->isSend) {
      captured->posted->record(stream);
      queueSend(*captured, op);
    } else {
      const bool announced = postRecv(*captured, op, options, stream);
      captured->posted->record(stream);
      // Every node the chain gets from now on comes after the recv's `ready`.
      if (announced) chains_.joinLater(captured->captureId, device, captured->posted);
    }
  } else if (captured->isSend) {
    captured->phase = CapturedOp::Phase::kQueued;  // nothing to move
  }
  // The graph keeps what its nodes use, to the end of its life (and of its executable graphs').
  cuda::onGraphDestroyed(capture.graph, [graveyard = graveyard_, captured]() mutable {
    graveyard->bury(std::move(captured));
  });
  {
    std::lock_guard<std::mutex> lock(capturedMutex_);
    captured_.push_back(captured);
  }
  return std::make_shared<CapturedChannelOp>(*this, std::move(captured));
}

bool CapturedChannel::postRecv(CapturedOp& recv, const Op& op, const PostOptions& options,
                               CUstream stream) {
  if (!options.placeKnown) return false;  // no send can tell it meets this recv: it takes a slot
  const Buffer& buffer = recv.buffer;
  PostedRecv notice{op.groupId, op.request.tag, op.seq, buffer.bytes, op.request.desc.dtype,
                    {}, {}, {}};
  try {
    std::lock_guard<std::mutex> lock(exportMutex_);
    notice.buffer = exporter_.exportBuffer(buffer.data, buffer.bytes, buffer.device,
                                           options.peerKey);
  } catch (const Error& error) {
    // Its sender then goes through its slot, which needs nothing of this buffer's.
    log(LogLevel::kInfo, recv.what, ": its buffer cannot be shared, so its send goes through a "
        "slot (", reasonOf(error), ")");
    return false;
  }
  recv.ready = std::make_unique<cuda::OwnedFlag>(flags_);
  recv.arrived = std::make_unique<cuda::OwnedFlag>(flags_);
  flags_.store(recv.ready->get(), 0);
  flags_.store(recv.arrived->get(), 0);
  notice.ready = recv.ready->get();
  notice.arrived = recv.arrived->get();
  // Set at every replay once the graph has reached the recv: a send that copies straight into
  // the buffer waits for it, since the graph may use the buffer before. It goes on the caller's
  // stream, not the chain: a recv never waited for then leaves no fork that would fail its
  // capture's end, and its wait() outside the capture is refused instead.
  cuda::writeWord(stream, flags_.cudaAddress(recv.ready->get().index), 1,
                  "cuStreamWriteValue32 (captured recv: its buffer is free)");
  std::string data;
  notice.appendTo(data);
  {
    std::lock_guard<std::mutex> lock(outboxMutex_);
    outbox_.emplace_back(options.peerKey, std::move(data));
  }
  return true;
}

void CapturedChannel::queueSend(CapturedOp& send, const Op& op) {
  std::optional<PostedRecvs::Entry> recv =
      postedRecvs_.take(send.peerKey, op.groupId, op.request.tag, op.seq, kDirectPatience);
  const CUstream chain = chains_.join(send.captureId, send.buffer.device, *send.posted);
  if (recv && recv->recv.bytes == send.buffer.bytes && recv->recv.dtype == op.request.desc.dtype) {
    queueDirect(send, *recv, chain);
  } else {
    // Its recv was not posted in time, or does not fit (the match then refuses both).
    queueThroughSlot(send, chain);
  }
  send.done->record(chain);
  send.phase = CapturedOp::Phase::kQueued;
}

void CapturedChannel::queueDirect(CapturedOp& send, const PostedRecvs::Entry& recv,
                                  CUstream chain) {
  const Buffer& buffer = send.buffer;
  const cuda::IpcExport& destination = recv.recv.buffer;
  send.destinationMapping = std::make_unique<cuda::PeerMapping>(
      destination, recv.ownerPidfd ? recv.ownerPidfd->get() : -1, buffer.device);
  send.destination = send.destinationMapping->addressOf(destination, buffer.bytes);
  send.receiverWords = recv.words;
  send.receiverReady = recv.recv.ready;
  send.receiverArrived = recv.recv.arrived;
  void* waiting = flags_.cudaAddress(send.waiting->get().index);
  takeWord(chain, waiting, send.receiverWords->cudaAddress(send.receiverReady.index),
           "cuStreamBatchMemOp (captured send: wait for its receiver's buffer)");
  cuda::queueCopyThrough(chain, buffer.device, {send.destination, destination.device},
                         cuda::Place::of(buffer.data, buffer.device), buffer.bytes, send.bounce,
                         "cuMemcpyAsync (captured send, into its receiver's buffer)");
  cuda::writeWord(chain, send.receiverWords->cudaAddress(send.receiverArrived.index), 1,
                  "cuStreamWriteValue32 (captured send: bytes arrived)");
  send.way = CapturedWay::kDirect;
  directSends_.fetch_add(1, std::memory_order_relaxed);
}

void CapturedChannel::queueThroughSlot(CapturedOp& send, CUstream chain) {
  const Buffer& buffer = send.buffer;
  // Through a peer GPU, the slot lies there: its copy in is then a single hop.
  const int bounceDevice = cuda::localCopies() == cuda::LocalCopies::kPeerGpu
                               ? cuda::bounceDevice(buffer.device)
                               : -1;
  const int slotDevice = bounceDevice >= 0 ? bounceDevice : buffer.device;
  send.slot = std::make_unique<cuda::DeviceMemory>(slotDevice, buffer.bytes);
  log(LogLevel::kInfo, send.what, ": a slot of ", buffer.bytes, " B on cuda:", slotDevice,
      " for the life of its graph (no recv of its size was posted within ",
      kDirectPatience.count() / 1000, " ms of it)");
  send.full = std::make_unique<cuda::OwnedFlag>(flags_);
  send.empty = std::make_unique<cuda::OwnedFlag>(flags_);
  flags_.store(send.full->get(), 0);
  flags_.store(send.empty->get(), 1);  // the first replay finds the slot free
  void* waiting = flags_.cudaAddress(send.waiting->get().index);
  void* empty = flags_.cudaAddress(send.empty->get().index);
  takeWord(chain, waiting, empty, "cuStreamBatchMemOp (captured send: wait for its slot)");
  cuda::queueCopyThrough(chain, buffer.device, {send.slot->address(), slotDevice},
                         cuda::Place::of(buffer.data, buffer.device), buffer.bytes, send.bounce,
                         "cuMemcpyAsync (captured send, into its slot)");
  cuda::writeWord(chain, flags_.cudaAddress(send.full->get().index), 1,
                  "cuStreamWriteValue32 (captured send: slot full)");
}

void CapturedChannel::queueRecv(CapturedOp& recv) {
  const Buffer& buffer = recv.buffer;
  cuda::ContextGuard context(buffer.device);
  void* waiting = flags_.cudaAddress(recv.waiting->get().index);
  const CUstream chain = chains_.join(recv.captureId, buffer.device, *recv.posted);
  if (recv.way == CapturedWay::kDirect) {
    takeWord(chain, waiting, flags_.cudaAddress(recv.arrived->get().index),
             "cuStreamBatchMemOp (captured recv: wait for its sender's copy)");
    recv.done->record(chain);
    recv.phase = CapturedOp::Phase::kQueued;
    return;
  }
  cuda::RemoteFlagSegment& words = *recv.sourceWords;
  void* full = words.cudaAddress(recv.source.full.index);
  takeWord(chain, waiting, full,
           "cuStreamBatchMemOp (captured recv: wait for its sender's slot)");
  const CUdeviceptr slot = recv.sourceSlot->addressOf(recv.source.memory, buffer.bytes);
  cuda::queueCopyThrough(chain, buffer.device, cuda::Place::of(buffer.data, buffer.device),
                         {slot, recv.source.memory.device}, buffer.bytes, recv.bounce,
                         "cuMemcpyAsync (captured recv, out of its sender's slot)");
  cuda::writeWord(chain, words.cudaAddress(recv.source.empty.index), 1,
                  "cuStreamWriteValue32 (captured recv: slot emptied)");
  recv.done->record(chain);
  recv.phase = CapturedOp::Phase::kQueued;
}

bool CapturedChannelOp::queued() { return op_->phase.load() != CapturedOp::Phase::kPosted; }

void CapturedChannelOp::waitOnStream(void* stream, int /*device*/) {
  channel_.waitOnStream(stream, *op_);
}

void CapturedChannel::waitOnStream(void* stream, CapturedOp& op) {
  const std::optional<cuda::Capture> capture = cuda::captureOf(static_cast<CUstream>(stream));
  if (!capture || capture->id != op.captureId) {
    fail(op.what, " was captured in another CUDA graph than the current stream captures: wait "
         "for it inside its own capture");
  }
  std::lock_guard<std::mutex> lock(op.mutex);
  if (op.phase.load() == CapturedOp::Phase::kMatched) queueRecv(op);
  if (op.done) op.done->waitOn(static_cast<CUstream>(stream));
}

}  // namespace smfree::engine
