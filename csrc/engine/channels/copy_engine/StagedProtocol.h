#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "engine/Op.h"
#include "engine/Status.h"
#include "engine/channels/copy_engine/CopyEngineContext.h"
#include "engine/channels/copy_engine/DirectProtocol.h"
#include "engine/channels/copy_engine/StagedStates.h"
#include "engine/channels/copy_engine/StagingRing.h"

namespace smfree::engine {

struct Peer;

struct StagedSend {
  ClearedSend send;
  std::shared_ptr<RemoteStagingRing> remote;  // the receiver's ring
  std::optional<StagedSlot> slot;             // once queued
  StagedSendState state = StagedSendState::kHeld;
};

struct StagedRecv {
  std::shared_ptr<Op> op;
  std::shared_ptr<StagingRing> ring;
  StagedSlot slot;
  StagedRecvState state = StagedRecvState::kCopyingOut;
};

// Staging (StagingRing.h): a send of kStagingMinBytes to SMFREE_STAGING_BYTES whose receiver's
// `ready` is not yet set when it is cleared goes to a slot of the receiver's ring instead, as
// soon as one is free, or directly (DirectProtocol) once `ready` is set, whichever comes first.
// The sender then tells the receiver the slot (a ChannelNotice); the receiver's copy engine
// waits for its `ready` and the slot's `full`, copies the slot out into the buffer, writes
// `done` and empties the slot. Both waits are for submitted work. Progress thread only.
class StagedProtocol {
 public:
  StagedProtocol(CopyEngineContext& context, DirectProtocol& direct, uint64_t stagingBytes)
      : context_(context), direct_(direct), stagingBytes_(stagingBytes) {}

  // Receiver: the ring its sender may stage `recv` in, as its clear-to-send carries it (empty:
  // none).
  std::string ringData(const Peer& source, const Op& recv);
  // Sender: a ring its receiver's clear-to-send named, kept for later sends.
  void learn(const Peer& destination, std::shared_ptr<RemoteStagingRing> ring);
  // Sender: holds a cleared send until a slot is free or its receiver is ready; sends it
  // direct where it cannot be staged or its receiver is ready.
  void start(ClearedSend send);
  // Receiver: a sender's notice that it copied a send into a slot.
  void onNotice(Peer& source, const std::string& data);

  bool progress();
  bool advanceHeld();  // held sends: staged once a slot is free, direct once ready
  void cancel(const Op& op);
  // Held sends to the peer fail; queued copies and copies out run on.
  void peerFailed(const Peer& peer, const Status& gone);
  // After the peer's transfers: releases its rings' waits and forgets its rings.
  void dropPeer(const std::string& processKey);

  std::string describeWait(const Op& op) const;
  void addStats(std::map<std::string, int64_t>& stats) const;
  bool busy() const { return !held_.empty() || !sends_.empty() || !recvs_.empty(); }

 private:
  using RingKey = std::pair<std::string, int>;  // (peer's process key, ring's device)

  bool stageable(uint64_t bytes) const;
  std::shared_ptr<StagingRing> ringFor(const Peer& source, int device);
  void submit(StagedSend send, const StagedSlot& slot);
  void enqueueStagedCopy(StagedSend& send, const StagedSlot& slot, CUstream stream);
  bool finish(StagedSend& send);
  void moveTo(StagedSend& send, StagedSendState to);
  void moveTo(StagedRecv& recv, StagedRecvState to);

  CopyEngineContext& context_;
  DirectProtocol& direct_;
  uint64_t stagingBytes_;
  std::map<RingKey, std::shared_ptr<StagingRing>> rings_;  // null: none can be had
  std::map<RingKey, std::shared_ptr<RemoteStagingRing>> remoteRings_;
  std::list<StagedSend> held_;   // cleared sends waiting for a slot or for `ready`
  std::list<StagedSend> sends_;  // copies into a receiver's slot, queued
  std::list<StagedRecv> recvs_;  // copies out of one of our slots, queued
  uint64_t stagedSends_ = 0;  // copied into a receiver's slot
  uint64_t stagedRecvs_ = 0;  // copied out of one of our slots
};

}  // namespace smfree::engine
