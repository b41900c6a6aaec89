// An op's bytes through UCX from its arming (recv) or clear-to-send (send): the movement that
// tracks them, and the pieces posted to UCX.
#include <cstring>
#include <optional>


#include "engine/Error.h"
#include "engine/Peer.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/PeerValue.h"
#include "engine/channels/ucx/UcxCudaOp.h"
#include "engine/channels/ucx/UcxMovement.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {
namespace {

ucs_memory_type_t memoryType(const Buffer& buffer) {
  return buffer.memory == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
}

}  // namespace

UcxMovement& UcxChannel::track(const std::shared_ptr<Op>& op, Peer& peer) {
  auto movement = std::make_unique<UcxMovement>();
  movement->op = op;
  movement->peer = &peer;
  ++op->outstanding;  // the buffer is the channel's until the movement ends
  UcxMovement& tracked = *movement;
  movements_[op->id] = std::move(movement);
  return tracked;
}

void UcxChannel::prepareSend(const std::shared_ptr<Op>& send, Peer& destination) {
  const UcxCudaOp* state = ucxCudaOp(*send);
  if (!state || !state->relay) return;
  // Relayed by its caller (prepare()), whose copies out are queued already.
  UcxMovement& movement = track(send, destination);
  movement.relayed = true;
  movement.started = true;
  movement.callerRelay = state->relay;
  movement.host = movement.callerRelay->host;
  ++relayedSends_;
}

std::string UcxChannel::armRecv(const std::shared_ptr<Op>& recv, Peer& source) {
  thread_.check("UcxChannel::armRecv");
  const UcxCudaOp* state = ucxCudaOp(*recv);
  std::shared_ptr<CallerRelay> callerRelay = state ? state->relay : nullptr;
  const bool relayed = callerRelay || relaysThroughHost(*recv, source);
  const uint64_t bytes = recv->request.buffer.bytes;
  const uint64_t pieceBytes = callerRelay ? callerRelay->pieceBytes
                              : relayed      ? relayPieceBytes(bytes, pieceBytes_)
                                            : 0;
  const ucp_tag_t tag = recv->id << kPieceBits;
  UcxMovement& movement = track(recv, source);
  movement.tag = tag;
  movement.setPieces(pieceBytes);
  movement.relayed = relayed;
  if (callerRelay) {
    movement.callerRelay = callerRelay;
    movement.host = callerRelay->host;
    movement.landedOnWorker.assign(movement.pieces.size(), 0);
    ++relayedRecvs_;
  } else if (relayed) {
    movement.host = relay_.take(recv->request.buffer.device, bytes);
    ++relayedRecvs_;
  }
  // A relayed recv lands in host memory, free to take the bytes before the stream reaches it.
  if (relayed || streamReached(*recv)) {
    movement.started = true;
    for (uint32_t piece = 0; piece < movement.pieces.size() && !movement.failure; ++piece) {
      postPiece(movement, piece);
    }
    if (movement.failure) fail(movement.failure->message);  // it ends in progress()
  }
  std::string channelData(sizeof(tag) + sizeof(pieceBytes), '\0');
  std::memcpy(channelData.data(), &tag, sizeof(tag));
  std::memcpy(channelData.data() + sizeof(tag), &pieceBytes, sizeof(pieceBytes));
  return channelData;
}

void UcxChannel::startSend(const std::shared_ptr<Op>& send, Peer& destination,
                           const std::string& channelData) {
  thread_.check("UcxChannel::startSend");
  // The clear-to-send's data, read and bounded here (PeerValue.h): the receiver's tag and
  // piece size, which may not cut the send into more than kMostPieces.
  constexpr const char* kMessage = "UCX clear-to-send's channel data";
  ucp_tag_t tag = 0;
  uint64_t pieceBytes = 0;
  const uint64_t bytes = send->request.buffer.bytes;
  if (channelData.size() != sizeof(tag) + sizeof(pieceBytes)) {
    badPeerValue(kMessage, "length", channelData.size(), " B, expected ",
                 sizeof(tag) + sizeof(pieceBytes), " B");
  }
  std::memcpy(&tag, channelData.data(), sizeof(tag));
  std::memcpy(&pieceBytes, channelData.data() + sizeof(tag), sizeof(pieceBytes));
  if (pieceBytes != 0 && bytes / pieceBytes + (bytes % pieceBytes != 0) > kMostPieces) {
    badPeerValue(kMessage, "piece bytes", pieceBytes, " B cut ", send->describe(),
                 " into more than ", kMostPieces, " pieces");
  }
  auto prepared = movements_.find(send->id);  // relayed: its copies out queued at its post
  UcxMovement& movement =
      prepared != movements_.end() ? *prepared->second : track(send, destination);
  movement.cleared = true;
  movement.tag = tag;
  movement.setPieces(pieceBytes);
  if (movement.relayed) {
    // Matched: from here its wait() leaves the buffer to the caller's stream, which waits for
    // the copies out. Not before, so a mismatch still reaches that wait().
    if (!movement.failure) flags_.set(ucxCudaOp(*send)->queued);
    countCopiedOut(movement);
    transmitCopiedPieces(movement);
  } else {
    startOnceStreamReached(movement);
  }
}

bool UcxChannel::startOnceStreamReached(UcxMovement& movement) {
  if (!streamReached(*movement.op)) return false;
  movement.started = true;
  for (uint32_t piece = 0; piece < movement.pieces.size() && !movement.failure; ++piece) {
    postPiece(movement, piece);
  }
  return true;
}

void UcxChannel::postPiece(UcxMovement& movement, uint32_t piece) {
  const Op& op = *movement.op;
  const Buffer& buffer = op.request.buffer;
  char* base = static_cast<char*>(movement.host ? movement.host->data() : buffer.data);
  void* data = base + movement.offsetOf(piece);
  const uint64_t bytes = movement.bytesOf(piece);
  const ucp_tag_t tag = movement.tag + piece;
  UcxEndpoint* endpoint = movement.isSend() ? endpointOf(*movement.peer) : nullptr;
  if (movement.isSend() && !endpoint) {
    movement.failure = Status::failure(
        StatusCode::kPeerFailure, concat(op.describe(), ": its peer's data endpoint is closed"));
    return;
  }

  auto transfer = std::make_unique<UcxTransfer>(UcxTransfer{this, &movement, piece});
  ucp_request_param_t params{};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  params.user_data = transfer.get();
  params.memory_type = movement.host ? UCS_MEMORY_TYPE_HOST : memoryType(buffer);
  // UCX's CUDA transports work in the current context: the buffer's device's primary one.
  std::optional<cuda::ContextGuard> context;
  if (!movement.host && buffer.memory == MemoryKind::kCuda) {
    context.emplace(buffer.device);
    cudaDevice_ = buffer.device;
    receiveWorker_.useCudaDevice(buffer.device);
  }
  movement.pieces[piece] = PieceState::kInUcx;
  UcxTransfer* owned = transfer.release();  // owned by the request until its callback
  void* request = nullptr;
  if (movement.isSend()) {
    params.cb.send = &UcxChannel::onSent;
    request = ucp_tag_send_nbx(endpoint->handle(), data, bytes, tag, &params);
  } else {
    params.cb.recv = &UcxChannel::onReceived;
    request = ucp_tag_recv_nbx(receiveWorker_.worker().handle(), data, bytes, tag, kFullMask,
                               &params);
  }
  if (UCS_PTR_IS_ERR(request)) {
    std::unique_ptr<UcxTransfer> back(owned);  // no callback will come
    movement.pieces[piece] = PieceState::kWaiting;
    movement.failure = Status::failure(
        StatusCode::kChannel, concat("UCX could not post ", op.describe(), ": ",
                                       ucxStatusText(UCS_PTR_STATUS(request))));
    return;
  }
  movement.requests.push_back(request);  // its completion is applied only after this
}

}  // namespace smfree::engine
