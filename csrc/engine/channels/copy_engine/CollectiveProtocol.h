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

struct Peer;

struct CollectiveTransfer {
  std::shared_ptr<Op> op;
  CollectiveState state = CollectiveState::kMoving;
};

// Collective lanes (CollectiveLanes.h): a collective's piece is copied at the post of whichever
// of its two ranks posts second, so that neither's wait() waits for the other; the op then only
// ends once the copy has written its `done` word. One that failed keeps its buffer while a copy
// may still come. Progress thread, but for lanes().
class CollectiveProtocol {
 public:
  CollectiveProtocol(CopyEngineContext& context, std::string processKey, size_t ipcCacheSize,
                     bool enabled);

  bool enabled() const { return enabled_; }  // SMFREE_COLLECTIVE_LANES
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
