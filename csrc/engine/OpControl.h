#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/Channels.h"
#include "engine/Failures.h"
#include "engine/GroupState.h"
#include "engine/Op.h"
#include "engine/Peer.h"
#include "engine/PeerLinks.h"
#include "engine/PeerValue.h"
#include "engine/ProgressThread.h"
#include "engine/Wire.h"

namespace smfree::engine {

// The control protocol between engines, and every op's life from its start on the progress
// thread to its release: a send is announced to its receiver (ReadyToSend), which matches it
// with a recv in posting order and clears it (ClearToSend, with what the channel needs to
// deliver the bytes) or refuses it (Refusal); a side that gives up tells the other
// (Cancellation). Owns the groups, as the progress thread sees them, and the live ops, whose
// state (OpState) changes in transition() alone. Progress thread only.
class OpControl {
 public:
  OpControl(Channels& channels, PeerLinks& peers, Failures& failures,
            const ProgressThread& thread);

  void registerGroup(std::shared_ptr<const GroupConfig> config);
  GroupState* findGroup(uint64_t groupId);
  // Fails the group's pending ops with `reason` and refuses new ones.
  void closeGroup(uint64_t groupId, StatusCode code, const std::string& reason);

  // A posted op: announced (send) or matched (recv) unless it is refused; also an op that an
  // admission hook held back (Channel::admit), once it lets it start.
  void startOp(const std::shared_ptr<Op>& op);

  void onReadyToSend(const ReadyToSend& message);
  void onClearToSend(const ClearToSend& message);
  void onRefusal(const Refusal& message);
  void onCancellation(const Cancellation& message);
  // A channel no longer touches the op's buffer (Channel::Done).
  void onTransferDone(const std::shared_ptr<Op>& op, const Status& status);
  // Fails the ops with the peer, which has just failed with `why`.
  void peerFailed(Peer& peer, const std::string& why);
  // A peer sent a value out of its bound: its ops fail, naming it and the field.
  void badValueFrom(Peer& peer, const BadPeerValue& error);
  // Fails the ops past their deadline.
  void expireOps(Clock::time_point now);
  // Probes the peers on other hosts that ops wait on, where they have gone silent
  // (PeerLinks::probeIfSilent): an op that times out on one then says whether it answered.
  void probeSilentPeers(Clock::time_point now);
  // The group's `rank`, if this process has reached it.
  Peer* peerOf(uint64_t groupId, int rank);
  // The engine shuts down, its progress thread gone: fails what is left and forgets it all.
  void shutDown();

  // Ops of the group (or of all) not yet ended whose caller's wait() may have returned.
  // Live ops whose caller's wait() may wait for this thread: not eager sends nor collective
  // lanes' pieces, whose wait() returns at once. The loop polls only while there are some.
  size_t opsAwaitingProgress() const { return awaitingProgress_; }
  size_t releasedOpsInFlight(std::optional<uint64_t> groupId);
  std::string dumpPending(uint64_t groupId);
  size_t liveOps() const { return live_.size(); }

 private:
  // Why a refused match is refused, and whether the sender is to hear it (one that cancelled
  // its send knows).
  struct MatchRefusal {
    Status status;
    bool tellSender;
  };

  // Moves the op to `next` and does what entering it takes: kEnded tells the caller `status`
  // and lets the channel release the caller's stream waits; kReleased gives the channel's
  // resources back and forgets the op. An ended op is released at once unless a channel
  // still holds its buffer. Returns false, changing nothing, where the op's state does not
  // allow the move (an op ends once; it is released once no channel holds it).
  bool transition(const std::shared_ptr<Op>& op, OpState next,
                  const Status& status = Status::success());
  // Ends the op with that failure (transition() to kEnded).
  void failOp(const std::shared_ptr<Op>& op, StatusCode code, std::string why);
  // Why a starting op is refused: its group closed, its peer failed, or its channel cannot
  // reach the peer.
  std::optional<Status> refusalAtStart(const Op& op, const GroupState* group);
  // Why a matched recv refuses the send: its channel cannot reach the sender, the sender gave
  // up, or the two disagree on size, dtype, device or channel.
  std::optional<MatchRefusal> refusalOfMatch(const GroupState& group, const Matcher::Match& match,
                                             const Peer& sender);
  void onMatched(GroupState& group, Matcher::Match& match);
  // An announcement no recv will arm: its channel gives back what the announcement holds.
  void discardAnnounced(GroupState& group, const ReadyToSend& rts, Op* recv = nullptr);
  // An op refused at its start keeps its place in its line (see the definition).
  void keepPlace(const std::shared_ptr<Op>& op, GroupState* group, const std::string& why);
  void expire(const std::shared_ptr<Op>& op, Clock::time_point now);
  // Why the op failed at its timeout: unmatched, or its bytes still moving, or its peer silent.
  std::string timeoutMessage(const Op& op, Clock::time_point now);
  // Whether a ready-to-send's source rank is in the group (logged where not). Its peer may not
  // be connected yet: it is announced all the same.
  bool rankInGroup(const GroupState& group, const ReadyToSend& message);
  // Queues the announcement; past Matcher's caps, fails the sender's ops instead.
  void announceOrFail(GroupState& group, ReadyToSend message);
  // The peer that a clear-to-send or refusal names, its rank checked against its group; null
  // (logged) where there is none.
  Peer* replier(uint64_t groupId, const char* message, int rank);
  void failOpsWith(Peer& peer, StatusCode code, const std::string& why);
  // Whether an op id a peer echoed names an op of that kind, group and partner.
  static bool isOwnOp(const Op& op, uint64_t groupId, int partner, OpKind kind);
  std::shared_ptr<Op> findLive(uint64_t opId);
  Peer* partnerOf(const Op& op);
  bool referencedByOpenGroup(const Peer& peer) const;

  Channels& channels_;
  PeerLinks& peers_;
  Failures& failures_;
  const ProgressThread& thread_;
  std::unordered_map<uint64_t, GroupState> groups_;
  std::unordered_map<uint64_t, std::shared_ptr<Op>> live_;
  size_t awaitingProgress_ = 0;  // of live_
  std::unordered_map<uint64_t, std::vector<ReadyToSend>> orphans_;  // for groups not joined yet
  size_t orphanCount_ = 0;  // of orphans_, all groups
};

}  // namespace smfree::engine
