#include "engine/channels/copy_engine/CollectiveProtocol.h"

#include "engine/Error.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/channels/copy_engine/CopyEnginePeer.h"

namespace smfree::engine {

CollectiveProtocol::CollectiveProtocol(CopyEngineContext& context, std::string processKey,
                                       size_t ipcCacheSize, bool enabled)
    : context_(context),
      lanes_(context.flags(), std::move(processKey), ipcCacheSize,
             [&context](const std::string& key, const PeerAddress& address,
                        int ownerPidfd) -> cuda::RemoteFlagSegment& {
               return context.flagsOf(key, address, ownerPidfd);
             }),
      enabled_(enabled) {}

bool CollectiveProtocol::takes(const Op& op, const PostOptions& options) const {
  return enabled_ && op.isCollective() && op.request.buffer.bytes != 0 && !options.peerKey.empty();
}

void CollectiveProtocol::post(Op& op, const PostOptions& options, CopyEngineOp& state) {
  cuda::FlagSegment& flags = context_.flags();
  if (op.isSend()) {
    state.done = flags.acquire(kDoneSpan);
    state.producedWord = flags.acquire();
    context_.cudaOps().writeFromStream(op, state.producedWord);
  }
  const PieceWords words{op.isSend() ? state.producedWord : state.ready, state.done,
                         state.produced.get()};
  state.collective = lanes_.post(op, options, words);
  // First: the partner's post queues the copy; second: this post did.
  if (state.collective) flags.set(state.queued);
}

void CollectiveProtocol::moveTo(CollectiveTransfer& transfer, CollectiveState to) {
  kCollectiveStates.advance(transfer.state, to, [&] { return transfer.op->describe(); });
}

void CollectiveProtocol::move(const std::shared_ptr<Op>& op) {
  for (CollectiveTransfer& transfer : moving_) {
    if (transfer.op == op) return;  // already held (ended())
  }
  ++op->outstanding;
  moving_.push_back(CollectiveTransfer{op});
}

void CollectiveProtocol::ended(Op& op) {
  CollectivePiece& piece = *copyEngineOp(op).collective;
  if (piece.role == CollectiveRole::kFirst) {
    if (CollectiveLanes::cancel(piece)) return;  // its partner will not take it now
    // Taken: the partner's copy comes, unless the partner is gone with it.
    if (lanes_.gone(piece.peerKey)) return;
  }
  move(op.shared_from_this());
}

void CollectiveProtocol::cancel(const Op& op) {
  const auto& piece = copyEngineOp(op).collective;
  if (piece->role == CollectiveRole::kSecond) CollectiveLanes::release(*piece);
}

bool CollectiveProtocol::progress() {
  bool moved = false;
  for (auto it = moving_.begin(); it != moving_.end();) {
    if (finish(*it)) {
      it = moving_.erase(it);
      moved = true;
    } else {
      ++it;
    }
  }
  return moved;
}

bool CollectiveProtocol::finish(CollectiveTransfer& transfer) {
  Op& op = *transfer.op;
  const cuda::Flag& done = copyEngineOp(op).done;
  const cuda::FlagSegment& flags = context_.flags();
  if (!flags.isSet(done.plus(kCopied))) return false;
  if (flags.wordOf(done) == done.value + kCopied) {
    moveTo(transfer, CollectiveState::kCopied);
    context_.end(transfer.op, Status::success());
  } else {
    moveTo(transfer, CollectiveState::kPartnerGaveUp);
    context_.end(transfer.op,
                 Status::failure(StatusCode::kAborted,
                                 concat(op.describe(), " failed: its partner could not queue the "
                                        "copy of its collective lane")));
  }
  return true;
}

void CollectiveProtocol::peerFailed(const Peer& peer, const Status& gone) {
  const std::string& key = processKeyOf(peer);
  for (auto it = moving_.begin(); it != moving_.end();) {
    CollectivePiece& piece = *copyEngineOp(*it->op).collective;
    if (piece.peerKey != key) {
      ++it;
    } else if (piece.role == CollectiveRole::kSecond) {
      CollectiveLanes::release(piece);  // our copy runs, from or into its still-mapped memory
      if (it->state == CollectiveState::kMoving) moveTo(*it, CollectiveState::kReleased);
      ++it;
    } else {
      const std::shared_ptr<Op> op = it->op;
      moveTo(*it, CollectiveState::kAbandoned);  // the dead peer's copy will never run
      it = moving_.erase(it);
      context_.end(op, gone);
    }
  }
  lanes_.dropPeer(key);
}

std::string CollectiveProtocol::describeWait(const Op& op) const {
  const CopyEngineOp& state = copyEngineOp(op);
  const bool first = state.collective->role == CollectiveRole::kFirst;
  const cuda::Flag wanted = state.done.plus(kCopied);
  return concat(", collective lane, ", first ? "posted first" : "copy queued at its post",
                ", done ", wanted.index, ":", context_.flags().wordOf(state.done), "/",
                wanted.value);
}

}  // namespace smfree::engine
