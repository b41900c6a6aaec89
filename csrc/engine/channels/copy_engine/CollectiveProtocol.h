#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <string>

#include "engine/Op.h"
#include "engine/Status.h"
#include "engine/channels/copy_engine/CollectiveLanes.h"
#include "engine/channels/copy_engine/CollectiveStates.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"

namespace smfree::engine {

struct CopyEngineOp;
struct Peer;

struct CollectiveTransfer {
  std::shared_ptr<Op> op;
  CollectiveState state = CollectiveState::kMoving;
};

// Collective lanes (CollectiveLanes.h): a collective's piece is copied at the post of whichever
// of its two ranks posts second, so that neither's wait() waits for the other; the op then only
// ends once the copy has written its `done` word. One that failed keeps its buffer while a copy
// may still come. Progress thread, but for takes(), post() and lanes().
class CollectiveProtocol {
 public:
  CollectiveProtocol(CopyEngineContext& context, std::string processKey, size_t ipcCacheSize,
                     bool enabled);

  // Whether a collective lane decides, at its post, how `op` goes (SMFREE_COLLECTIVE_LANES):
  // an uncaptured CUDA piece of a collective, not empty, to a known peer.
  bool takes(const Op& op, const PostOptions& options) const;
  // Caller's thread, at the post of a piece it takes, `state` holding its `queued`, its
  // `produced` event recorded (a recv's: its buffer is free), and a recv's `done` and `ready`:
  // adds a send's `done` and `producedWord` and posts the piece to its lane; state.collective
  // stays null where it goes by rendezvous. Throws Error; what it acquired is then in
  // `state`, for the caller to release.
  void post(Op& op, const PostOptions& options, CopyEngineOp& state);
  CollectiveLanes& lanes() { return lanes_; }
  const CollectiveLanes& lanes() const { return lanes_; }

  // An op of a lane reached its match or clearance: it moves until its `done` word is written.
  void move(const std::shared_ptr<Op>& op);
  // An op of a lane failed: its partner's copy may still come, and then it holds its buffer.
  void ended(Op& op);
  // A queued copy cannot be taken back; the op ends once it ran. Ours must not stay parked on
  // a wedged peer's stream.
  static void cancel(const Op& op);
  bool progress();
  void peerFailed(const Peer& peer, const Status& gone);

  std::string describeWait(const Op& op) const;
  bool busy() const { return !moving_.empty(); }

 private:
  bool finish(CollectiveTransfer& transfer);
  void moveTo(CollectiveTransfer& transfer, CollectiveState to);

  CopyEngineContext& context_;
  CollectiveLanes lanes_;
  const bool enabled_;
  std::list<CollectiveTransfer> moving_;
};

}  // namespace smfree::engine
