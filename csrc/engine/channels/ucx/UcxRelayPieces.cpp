// Pieces of a CUDA op relayed through pinned host memory (HostRelay): a send's copied out
// and transmitted in order, a recv's copied in as they land.


#include "engine/Error.h"
#include "engine/Peer.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/channels/ucx/UcxCudaOp.h"
#include "engine/channels/ucx/UcxMovement.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

Status copyFailure(const Op& op, const Error& error) {
  return Status::failure(StatusCode::kChannel, concat(op.describe(), ": ", error.what()));
}

}  // namespace

void UcxChannel::releaseWaitingCopiesIn(UcxMovement& movement) {
  if (!movement.callerRelay || movement.isSend()) return;
  CallerRelay& relay = *movement.callerRelay;
  int state = CallerRelay::kCopiesInOpen;
  if (relay.copiesIn.compare_exchange_strong(state, CallerRelay::kCopiesInNever)) return;
  // Its caller's stream waits for pieces that will not land now: let the copies run over
  // what is there, so the stream goes on; the op reports the failure.
  flags_.set(relay.lastPiece());
}

bool UcxChannel::countCopiedOut(UcxMovement& movement) {
  const CallerRelay& relay = *movement.callerRelay;
  const uint32_t word = flags_.wordOf(relay.progress);
  if (!cuda::reached(word, relay.progress.value)) return false;
  const uint64_t out = std::min<uint64_t>(word - relay.progress.value + 1, relay.pieces);
  const uint64_t copiedOut =
      relay.pieceBytes == 0 ? relay.bytes : std::min(out * relay.pieceBytes, relay.bytes);
  if (copiedOut == movement.copiedOut) return false;
  movement.copiedOut = copiedOut;
  return true;
}

bool UcxChannel::transmitCopiedPieces(UcxMovement& movement) {
  bool posted = false;
  while (movement.nextToTransmit < movement.pieces.size() && !movement.failure) {
    const uint32_t piece = movement.nextToTransmit;
    if (movement.offsetOf(piece) + movement.bytesOf(piece) > movement.copiedOut) break;
    postPiece(movement, piece);
    ++movement.nextToTransmit;
    posted = true;
  }
  return posted;
}

bool UcxChannel::copyInLandedPieces(UcxMovement& movement) {
  auto& pieces = movement.pieces;
  if (std::find(pieces.begin(), pieces.end(), PieceState::kLanded) == pieces.end()) return false;
  const Op& op = *movement.op;
  const Buffer& buffer = op.request.buffer;
  const UcxCudaOp& state = *ucxCudaOp(op);
  try {
    // The copies wait on the GPU for the caller's stream to free the buffer, not the CPU.
    if (movement.copiesInQueued == 0) {
      relay_.copyToDeviceAfter(buffer.device, *state.reached);
    }
    for (uint32_t piece = 0; piece < pieces.size(); ++piece) {
      if (pieces[piece] != PieceState::kLanded) continue;
      movement.copies[piece] = relay_.copyToDevice(*movement.host, buffer,
                                                     movement.offsetOf(piece),
                                                     movement.bytesOf(piece));
      pieces[piece] = PieceState::kCopying;
      ++movement.copiesInQueued;
    }
    if (movement.copiesInQueued == pieces.size()) {
      // From here the caller's stream, not its CPU, waits for the bytes.
      relay_.recordAfterCopiesToDevice(buffer.device, *state.copied);
      flags_.set(state.queued);
    }
  } catch (const Error& error) {
    movement.failure = copyFailure(op, error);
  }
  return true;
}

bool UcxChannel::countCopiedInPieces(UcxMovement& movement) {
  bool counted = false;
  for (uint32_t piece = 0; piece < movement.pieces.size(); ++piece) {
    if (movement.pieces[piece] != PieceState::kCopying || !movement.copies[piece]->reached()) {
      continue;
    }
    movement.copies[piece].reset();
    movement.pieces[piece] = PieceState::kDone;
    ++movement.done;
    counted = true;
  }
  return counted;
}

void UcxChannel::markLanded(UcxMovement& movement, uint32_t piece) {
  movement.landedOnWorker[piece] = 1;
  const uint32_t before = movement.landedInOrder;
  while (movement.landedInOrder < movement.landedOnWorker.size() &&
         movement.landedOnWorker[movement.landedInOrder]) {
    ++movement.landedInOrder;
  }
  // Straight from the receive worker: the copies in that wait for it do not depend on the
  // progress thread.
  if (movement.landedInOrder > before) {
    flags_.set(movement.callerRelay->progress.plus(movement.landedInOrder - 1));
  }
}

}  // namespace smfree::engine
