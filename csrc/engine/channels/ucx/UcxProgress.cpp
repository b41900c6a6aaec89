// The progress thread's pass over UCX's movements: the completions UCX's callbacks queued,
// applied here; what each movement's state allows next; and the end of a movement.
#include <mutex>


#include "engine/Error.h"
#include "engine/Peer.h"
#include "engine/channels/ucx/UcxChannel.h"
#include "engine/channels/ucx/UcxMovement.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {
namespace {

Status abandoned(const Op& op) {
  return Status::failure(StatusCode::kAborted, concat(op.describe(), " was cancelled"));
}

// A request that ended in error: its peer's connection failed, which UCX may say here before
// the endpoint's error callback.
Status transportFailure(const Op& op, const Peer& peer, ucs_status_t status) {
  if (peer.failed) {
    return Status::failure(StatusCode::kPeerFailure,
                           concat(op.describe(), " failed: ", peer.failure));
  }
  return Status::failure(StatusCode::kChannel,
                         concat(op.describe(), " failed: UCX could not move its bytes ",
                                op.isSend() ? "to" : "from", " its peer process (",
                                peer.describe(), "): ", ucxPeerErrorText(status)));
}

}  // namespace

Progress UcxChannel::progress() {
  thread_.check("UcxChannel::progress");
  startHeldOps();
  bool changed = applyCompletions();
  std::vector<uint64_t> ended;
  for (auto& [id, movement] : movements_) {
    changed = advance(*movement) || changed;
    if (movementEnded(*movement)) ended.push_back(id);
  }
  for (const uint64_t id : ended) {
    auto it = movements_.find(id);
    std::unique_ptr<UcxMovement> movement = std::move(it->second);
    movements_.erase(it);
    --movement->op->outstanding;
    onDone_(movement->op, movement->failure ? *movement->failure : Status::success());
    changed = true;
  }
  // The device of the latest CUDA buffer handed to UCX; -1 before the first.
  return Progress{changed, cudaDevice_};
}

bool UcxChannel::advance(UcxMovement& movement) {
  if (movement.op->finished() && !movement.failure) {
    movement.failure = abandoned(*movement.op);  // timed out, or its peer failed
  }
  if (movement.failure) {
    if (movement.cancelled) return false;
    movement.cancelled = true;
    releaseWaitingCopiesIn(movement);
    cancelRequests(movement);
    return true;
  }
  // A send tracked before its clear-to-send is a relayed one, copied out at its post.
  if (movement.isSend() && !movement.cleared) return countCopiedOut(movement);
  if (!movement.started) return startOnceStreamReached(movement);
  if (!movement.relayed) return false;
  if (movement.callerRelay && !movement.isSend()) return false;  // its caller copies in
  if (movement.isSend()) {
    const bool counted = countCopiedOut(movement);
    return transmitCopiedPieces(movement) || counted;
  }
  const bool copying = copyInLandedPieces(movement);
  return countCopiedInPieces(movement) || copying;
}

bool UcxChannel::movementEnded(const UcxMovement& movement) const {
  if (!movement.requests.empty()) return false;
  if (movement.failure) return !movement.copyPending(flags_);
  if (movement.callerRelay && !movement.isSend() &&
      !flags_.isSet(movement.callerRelay->copiedIn)) {
    return false;
  }
  return (!movement.isSend() || movement.cleared) && movement.done == movement.pieces.size();
}

bool UcxChannel::busy() const {
  // Pieces inside UCX need nothing from the loop: their completions wake it.
  {
    std::lock_guard<std::mutex> lock(completionsMutex_);
    if (!completions_.empty()) return true;
  }
  for (const auto& [id, movement] : movements_) {
    if (!movement->started || movement->failure || movementEnded(*movement)) return true;
    if (const auto& relay = movement->callerRelay) {
      // Words that streams write, polled: a send's copies out, a recv's copies in once its
      // wait() has queued them.
      if (movement->isSend() ? movement->copiedOut < relay->bytes
                             : relay->copiesIn.load() == CallerRelay::kCopiesInByCaller) {
        return true;
      }
    }
    for (const PieceState state : movement->pieces) {
      if (state == PieceState::kCopying || state == PieceState::kLanded) return true;
    }
  }
  return false;
}

void UcxChannel::cancel(Op& op) {
  auto it = movements_.find(op.id);
  if (it == movements_.end()) return;
  UcxMovement& movement = *it->second;
  // Its requests are cancelled by the next progress(), once the completions queued before it
  // are applied: this may run inside UCX (a peer's failure it reports), where some of them
  // have completed with their completions still queued.
  if (!movement.failure) movement.failure = abandoned(op);
}

void UcxChannel::cancelRequests(UcxMovement& movement) {
  if (!movement.isSend()) {
    receiveWorker_.cancel(movement.requests);  // its thread completes them meanwhile
    return;
  }
  // The engine's worker completes sends on this thread alone, so UCX's own check for a
  // completed request holds here.
  for (void* request : movement.requests) ucp_request_cancel(sendWorker_.handle(), request);
}

void UcxChannel::enqueue(const Completion& completion, bool wakeEngine) {
  {
    std::lock_guard<std::mutex> lock(completionsMutex_);
    completions_.push_back(completion);
  }
  if (wakeEngine) sendWorker_.signal();
}

bool UcxChannel::applyCompletions() {
  std::vector<Completion> completions;
  {
    std::lock_guard<std::mutex> lock(completionsMutex_);
    completions.swap(completions_);
  }
  for (const Completion& completion : completions) finish(completion);
  return !completions.empty();
}

void UcxChannel::finish(const Completion& completion) {
  std::unique_ptr<UcxTransfer> transfer(completion.transfer);
  UcxMovement& movement = *transfer->movement;
  const uint32_t piece = transfer->piece;
  auto& requests = movement.requests;
  requests.erase(std::find(requests.begin(), requests.end(), completion.request));
  ucp_request_free(completion.request);
  std::optional<Status> failure;
  if (completion.status != UCS_OK) {
    failure = transportFailure(*movement.op, *movement.peer, completion.status);
  } else if (!movement.isSend() && completion.length != movement.bytesOf(piece)) {
    failure = Status::failure(StatusCode::kChannel,
                              concat(movement.op->describe(), " received ", completion.length,
                                     " B in piece ", piece, " of ", movement.bytesOf(piece),
                                     " B"));
  }
  if (failure) {
    if (!movement.failure) movement.failure = std::move(failure);
    return;
  }
  if (movement.relayed && !movement.isSend() && !movement.callerRelay) {
    movement.pieces[piece] = PieceState::kLanded;
    return;
  }
  movement.pieces[piece] = PieceState::kDone;
  ++movement.done;
}

void UcxChannel::onSent(void* request, ucs_status_t status, void* userData) {
  auto* transfer = static_cast<UcxTransfer*>(userData);
  // On the engine's thread, inside its worker's progress or a post or cancel.
  transfer->channel->enqueue(Completion{transfer, request, status, 0}, false);
}

void UcxChannel::onReceived(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                            void* userData) {
  auto* transfer = static_cast<UcxTransfer*>(userData);
  const size_t length = status == UCS_OK ? info->length : 0;
  UcxMovement& movement = *transfer->movement;
  if (movement.callerRelay && status == UCS_OK &&
      length == movement.bytesOf(transfer->piece)) {
    transfer->channel->markLanded(movement, transfer->piece);
  }
  transfer->channel->enqueue(Completion{transfer, request, status, length}, true);
}

}  // namespace smfree::engine
