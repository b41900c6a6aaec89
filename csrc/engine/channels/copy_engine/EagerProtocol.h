#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>

#include "engine/Op.h"
#include "engine/Status.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"
#include "engine/channels/copy_engine/EagerLanes.h"
#include "engine/channels/copy_engine/EagerStates.h"
#include "engine/channels/copy_engine/StagingRing.h"

namespace smfree::engine {

struct Peer;

struct EagerSendTransfer {
  std::shared_ptr<Op> op;
  Peer* peer = nullptr;
  StagedSlot slot;  // of its receiver's lane
  EagerSendState state = EagerSendState::kQueued;
};

struct EagerRecvTransfer {
  std::shared_ptr<Op> op;
  std::shared_ptr<StagingRing> ring;  // not where its caller copies out
  StagedSlot slot;
  std::shared_ptr<EagerRecv> claim;   // where its caller copies out
  EagerRecvState state = EagerRecvState::kCopyingOut;
};

// Eager lanes (EagerLanes.h): a send of up to SMFREE_EAGER_BYTES on a lane its receiver has
// opened is copied at its post, on the caller's thread, into the lane's slot for its number; its
// `queued` is set at once, so its wait() returns at once. A recv's wait() that can tell from the
// lane that its message can be eager claims it so and queues the copy out itself, on its
// stream, without waiting for the sender. Otherwise the progress thread queues it at the match
// (wait for `ready` and the slot's `full`, copy, write `done` and `emptied`), as for a staged
// send. A send whose slot is still full at its post goes by rendezvous, or, where the receiver's
// wait() claimed it eager, is held: the progress thread copies it once the slot is empty, and
// its `queued` waits for that. Progress thread, but for lanes() and countSend().
class EagerProtocol {
 public:
  EagerProtocol(CopyEngineContext& context, uint64_t eagerBytes)
      : context_(context), lanes_(context.flags(), context.ringMemory(), eagerBytes) {}

  // Caller's thread: the lanes an op's post pushes to or posts at; counts a send pushed.
  EagerLanes& lanes() { return lanes_; }
  void countSend() { eagerSends_.fetch_add(1, std::memory_order_relaxed); }

  // Sender: the slot an eager send filled, for its announcement (empty: not eager).
  std::string announce(const Op& send) const;
  // Sender: an eager send announced; it moves until its copy ran and its receiver cleared it.
  void prepareSend(const std::shared_ptr<Op>& send, Peer& destination);
  // Sender: its receiver took the slot.
  void cleared(const std::shared_ptr<Op>& send);
  // Sender: the eager ring a clear-to-send named opens the send's lane (`words`: its
  // receiver's flag segment).
  void open(const Op& send, const Peer& destination, std::shared_ptr<RemoteStagingRing> ring,
            cuda::RemoteFlagSegment& words);
  // Receiver: an eager send's announcement, before its match.
  void announced(const Peer& source, const std::string& channelData, const LaneKey& lane,
                 uint64_t seq);
  // Receiver: the eager ring a recv's clear-to-send names (empty: none), for a send that could
  // have gone eagerly and did not.
  std::string ringData(const Op& recv, const Peer& source);
  // Receiver: the slot an eager send filled; queues its copy out unless its caller does.
  std::string arm(const std::shared_ptr<Op>& recv, Peer& source, const std::string& announced);
  // Receiver: empties the slot of an announced send no recv takes.
  void discard(const Peer& source, const std::string& channelData, const LaneKey& lane);
  // A recv whose caller claimed its copy out failed: lets that copy run (into a failed recv)
  // or, where it was not queued, empties the slot.
  void release(EagerRecv& recv);

  bool progress();
  // Empties the slots of held sends no recv took, once their copies have landed.
  bool emptyHeldSlots();
  // A held send fails now: its copy is never queued.
  void cancel(const Op& op);
  void peerFailed(const Peer& peer, const Status& gone);
  void dropPeer(const std::string& processKey) { lanes_.dropPeer(processKey); }

  std::string describeWait(const Op& op) const;
  void addStats(std::map<std::string, int64_t>& stats) const;
  bool busy() const { return !sends_.empty() || !recvs_.empty(); }

 private:
  bool finish(EagerSendTransfer& send);
  bool finish(EagerRecvTransfer& recv);
  // A held send: queues its copy once the slot is empty; false until then.
  bool fill(EagerSendTransfer& send);
  // A held recv: queues its copy out once the slot is full; false until then.
  bool copyOutOnceFull(EagerRecvTransfer& recv);
  void moveTo(EagerSendTransfer& send, EagerSendState to);
  void moveTo(EagerRecvTransfer& recv, EagerRecvState to);

  CopyEngineContext& context_;
  EagerLanes lanes_;
  std::atomic<uint64_t> eagerSends_{0};
  uint64_t eagerRecvs_ = 0;
  struct HeldSlot {
    std::shared_ptr<StagingRing> ring;
    StagedSlot slot;
  };
  std::list<HeldSlot> heldSlots_;  // of held sends no recv took (discard)
  std::list<EagerSendTransfer> sends_;
  std::list<EagerRecvTransfer> recvs_;
};

}  // namespace smfree::engine
