// UCX's work on the caller's thread for CUDA ops: what an op enqueues on the caller's stream
// at its post (a relayed send's copies out among it), the copies in that a relayed recv's wait()
// queues, and the fence the caller's stream waits on; and what the progress thread gives back
// once the op has ended.
#include <mutex>
#include <optional>

#include "engine/Log.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/channels/ucx/UcxChannelOp.h"

namespace smfree::engine {

std::shared_ptr<ChannelOp> UcxChannel::prepare(Op& op, const PostOptions& options) {
  if (op.request.buffer.memory != MemoryKind::kCuda) return hostOp_;
  std::call_once(announcedCuda_, [this] {
    log(LogLevel::kInfo, "CUDA tensors to some ranks move over UCX (SMFREE_CHANNEL=",
        cudaChannel_ == CudaChannel::kUcx ? "ucx" : "auto, ranks on other hosts", ")");
  });
  const bool relayed = options.route.relaysThroughHost && op.request.peer != kAnySource &&
                      op.request.buffer.bytes > 0;
  cudaOps_.admit(options.timeout);
  UcxCudaOp state;
  std::optional<cuda::Flag> queued;
  try {
    state.streamReady = flags_.acquire();
    cudaOps_.writeFromStream(op, state.streamReady);
    const int device = op.request.buffer.device;
    state.reached = cuda::takeEvent(device);
    state.copied = cuda::takeEvent(device);
    state.reached->record(static_cast<CUstream>(op.request.stream));
    queued = flags_.acquire();
    state.queued = *queued;
    if (relayed) state.relay = relayFromCaller(op, state);
  } catch (...) {
    // A value of 0 is never handed out: that word was not acquired.
    if (state.streamReady.value != 0) flags_.release(state.streamReady);
    if (queued) flags_.release(*queued);
    cudaOps_.retire();
    throw;
  }
  // UCX moves an unrelayed op's CUDA memory itself, from the progress thread.
  const OpTraits traits{.callsCudaOnProgressThread = !relayed,
                        .queuedByWait = relayed && !op.isSend()};
  return std::make_shared<UcxChannelOp>(*this, std::move(state), traits);
}

std::shared_ptr<UcxChannelOp> UcxChannel::makeHostOp() {
  return std::make_shared<UcxChannelOp>(*this);
}

UcxChannelOp::UcxChannelOp(UcxChannel& channel, UcxCudaOp cuda, OpTraits traits)
    : UcxCudaOpHolder(traits, std::move(cuda)),
      channel_(channel),
      queued_(this->cuda()->queued),
      copied_(this->cuda()->copied),
      relayedRecv_(traits.queuedByWait ? this->cuda()->relay : nullptr) {}

std::shared_ptr<CallerRelay> UcxChannel::relayFromCaller(const Op& op,
                                                           const UcxCudaOp& state) {
  const Buffer& buffer = op.request.buffer;
  auto relay = std::make_shared<CallerRelay>();
  relay->data = buffer.data;
  relay->bytes = buffer.bytes;
  relay->device = buffer.device;
  relay->pieceBytes = relayPieceBytes(buffer.bytes, pieceBytes_);
  relay->pieces =
      static_cast<uint32_t>(relayPieceCount(buffer.bytes, relay->pieceBytes));
  relay->reached = state.reached;
  relay->copied = state.copied;
  relay->queued = state.queued;
  relay->host = relay_.take(buffer.device, buffer.bytes);
  relay->progress = flags_.acquire(relay->pieces);
  try {
    if (op.isSend()) {
      relay_.copyOutInPieces(*relay, flags_);
    } else {
      relay->copiedIn = flags_.acquire();
    }
  } catch (...) {
    flags_.release(relay->progress);
    throw;
  }
  return relay;
}

bool UcxChannelOp::queued() {
  if (relayedRecv_) return channel_.queueCopiesInOnceMatched(*relayedRecv_);
  return channel_.flags_.isSet(queued_);
}

bool UcxChannel::queueCopiesInOnceMatched(CallerRelay& relay) {
  if (flags_.isSet(relay.queued)) return true;  // queued, or the recv failed
  // Matched with a promised send, the copies wait on the GPU for bytes whose copies out are
  // already queued on the sender's GPU, and which no thread that could stall has to move.
  // Otherwise they are queued only once the bytes are here: a stream must wait for nothing
  // else.
  const int matched = relay.matched.load(std::memory_order_acquire);
  const bool mayQueue =
      matched == CallerRelay::kMatchedPromised ||
      (matched == CallerRelay::kMatchedUnpromised && flags_.isSet(relay.lastPiece()));
  if (!mayQueue) return false;
  int state = CallerRelay::kCopiesInOpen;
  if (!relay.copiesIn.compare_exchange_strong(state, CallerRelay::kCopiesInByCaller)) {
    return false;  // another thread queues them, or the recv failed: `queued` follows
  }
  try {
    relay_.copyInAsPiecesLand(relay, flags_);
  } catch (...) {
    flags_.set(relay.copiedIn);  // the progress thread must not wait for it
    flags_.set(relay.queued);
    throw;
  }
  flags_.set(relay.queued);
  sendWorker_.signal();  // the progress thread watches `copiedIn` from now on
  return true;
}

void UcxChannelOp::waitOnStream(void* stream, int device) {
  // Never recorded for an unrelayed op, whose caller's CPU waited for its end: no wait then.
  copied_->waitOn(static_cast<CUstream>(stream));
}

void UcxChannel::ended(Op& op) {
  // A UCX op's waiter, if its copies never set `queued`, waits for the end on the CPU.
  if (const UcxCudaOp* state = ucxCudaOp(op)) flags_.set(state->queued);
}

bool UcxChannel::outlivesWait(const Op& op) const {
  const UcxCudaOp* state = ucxCudaOp(op);
  return state && flags_.isSet(state->queued);
}

void UcxChannel::release(Op& op) {
  UcxCudaOp* state = ucxCudaOp(op);
  if (!state) return;
  if (state->promised) --commitments_;
  flags_.release(state->queued);
  if (const auto& relay = state->relay) {
    if (op.isSend()) {
      cudaOps_.releaseOnceWritten(relay->lastPiece());  // a failed send's copies may still run
    } else {
      flags_.release(relay->progress);
      flags_.release(relay->copiedIn);
    }
    relay->host.reset();
  }
  state->reached.reset();
  state->copied.reset();
  cudaOps_.releaseOnceWritten(state->streamReady);
  cudaOps_.retire();
}

}  // namespace smfree::engine
