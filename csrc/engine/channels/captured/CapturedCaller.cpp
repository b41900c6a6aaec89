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

CUdeviceptr address(void* pointer) { return reinterpret_cast<CUdeviceptr>(pointer); }

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

CudaFence CapturedChannel::prepare(Op& op, const PostOptions& options) {
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
    captured->posted = std::make_unique<cuda::Event>(device);
    captured->done = std::make_unique<cuda::Event>(device);
    const auto stream = static_cast<CUstream>(op.request.stream);
    captured->posted->record(stream);
    if (captured->isSend) queueSend(*captured);
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
  op.channelState = std::make_unique<CapturedState>(captured);
  return CudaFence{.channel = ChannelKind::kCaptured, .captured = std::move(captured)};
}

void CapturedChannel::queueSend(CapturedOp& send) {
  const Buffer& buffer = send.buffer;
  // Through a peer GPU, the slot lies there: its copy in is then a single hop.
  const int bounceDevice = cuda::localCopies() == cuda::LocalCopies::kPeerGpu
                               ? cuda::bounceDevice(buffer.device)
                               : -1;
  const int slotDevice = bounceDevice >= 0 ? bounceDevice : buffer.device;
  send.slot = std::make_unique<cuda::DeviceMemory>(slotDevice, buffer.bytes);
  log(LogLevel::kInfo, send.what, ": a slot of ", buffer.bytes, " B on cuda:", slotDevice,
      " for the life of its graph");
  send.full = std::make_unique<cuda::OwnedFlag>(flags_);
  send.empty = std::make_unique<cuda::OwnedFlag>(flags_);
  flags_.store(send.full->get(), 0);
  flags_.store(send.empty->get(), 1);  // the first replay finds the slot free
  void* waiting = flags_.cudaAddress(send.waiting->get().index);
  void* empty = flags_.cudaAddress(send.empty->get().index);
  const CUstream chain = chains_.join(send.captureId, buffer.device, *send.posted);
  takeWord(chain, waiting, empty, "cuStreamBatchMemOp (captured send: wait for its slot)");
  cuda::queueCopyThrough(chain, buffer.device, {send.slot->address(), slotDevice},
                         {address(buffer.data), buffer.device}, buffer.bytes, send.bounce,
                         "cuMemcpyAsync (captured send, into its slot)");
  cuda::writeWord(chain, flags_.cudaAddress(send.full->get().index), 1,
                  "cuStreamWriteValue32 (captured send: slot full)");
  send.done->record(chain);
  send.phase = CapturedOp::Phase::kQueued;
}

void CapturedChannel::queueRecv(CapturedOp& recv) {
  const Buffer& buffer = recv.buffer;
  cuda::ContextGuard context(buffer.device);
  cuda::RemoteFlagSegment& words = *recv.sourceWords;
  void* waiting = flags_.cudaAddress(recv.waiting->get().index);
  void* full = words.cudaAddress(recv.source.full.index);
  const CUstream chain = chains_.join(recv.captureId, buffer.device, *recv.posted);
  takeWord(chain, waiting, full,
           "cuStreamBatchMemOp (captured recv: wait for its sender's slot)");
  const CUdeviceptr slot = recv.sourceSlot->address() +
                           (recv.source.memory.address - recv.source.memory.start());
  cuda::queueCopyThrough(chain, buffer.device, {address(buffer.data), buffer.device},
                         {slot, recv.source.memory.device}, buffer.bytes, recv.bounce,
                         "cuMemcpyAsync (captured recv, out of its sender's slot)");
  cuda::writeWord(chain, words.cudaAddress(recv.source.empty.index), 1,
                  "cuStreamWriteValue32 (captured recv: slot emptied)");
  recv.done->record(chain);
  recv.phase = CapturedOp::Phase::kQueued;
}

bool CapturedChannel::fenceQueued(const CudaFence& fence) {
  return fence.captured->phase.load() != CapturedOp::Phase::kPosted;
}

void CapturedChannel::waitOnStream(void* stream, int device, const CudaFence& fence) {
  CapturedOp& op = *fence.captured;
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
