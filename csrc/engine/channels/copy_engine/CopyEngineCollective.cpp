// Collective lanes on the progress thread: an op whose copy a post queued (CollectiveLanes.h) moves
// from its match or clearance until its `done` word says the copy ran; one that failed first keeps
// its buffer while a copy may still come.
#include "engine/Error.h"
#include "engine/Peer.h"
#include "engine/channels/copy_engine/CopyEngineChannel.h"

namespace smfree::engine {

void CopyEngineChannel::moveCollective(const std::shared_ptr<Op>& op, Peer* peer) {
  for (Transfer& transfer : moving_) {
    if (transfer.op == op) return;  // already held (endCollective)
  }
  ++op->outstanding;
  moving_.push_back(Transfer{.op = op, .peer = peer, .collective = true});
}

void CopyEngineChannel::endCollective(Op& op) {
  CollectivePiece& piece = *copyEngineOp(op).collective;
  if (piece.role == CollectiveRole::kFirst) {
    if (CollectiveLanes::cancel(piece)) return;  // its partner will not take it now
    // Taken: the partner's copy comes, unless the partner is gone with it.
    if (collectiveLanes_.gone(piece.peerKey)) return;
  }
  moveCollective(op.shared_from_this(), nullptr);
}

bool CopyEngineChannel::finishCollective(Transfer& transfer) {
  Op& op = *transfer.op;
  const cuda::Flag& done = copyEngineOp(op).done;
  if (!flags_.isSet(done.plus(kCopied))) return false;
  --op.outstanding;
  if (flags_.wordOf(done) == done.value + kCopied) {
    onDone_(transfer.op, Status::success());
  } else {
    onDone_(transfer.op,
            Status::failure(StatusCode::kAborted, concat(op.describe(),
                                                         " failed: its partner could not "
                                                         "queue the copy of its collective lane")));
  }
  return true;
}

void CopyEngineChannel::peerFailedCollective(const Peer& peer) {
  const std::string& key = peer.address.processKey;
  const Status gone = Status::failure(StatusCode::kPeerFailure, peer.failure);
  for (auto it = moving_.begin(); it != moving_.end();) {
    CollectivePiece* piece = it->collective ? copyEngineOp(*it->op).collective.get() : nullptr;
    if (!piece || piece->peerKey != key) {
      ++it;
    } else if (piece->role == CollectiveRole::kSecond) {
      CollectiveLanes::release(*piece);  // our copy runs, from or into its still-mapped memory
      ++it;
    } else {
      it = abandon(it, gone);  // the dead peer's copy will never run
    }
  }
  collectiveLanes_.dropPeer(key);
}

}  // namespace smfree::engine
