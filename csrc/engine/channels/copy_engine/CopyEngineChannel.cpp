// The progress thread's side of the copy engines: each call goes to the protocol of its op
// (CopyEngineOp says which: eager, collective, or neither), or, for what concerns a peer, to
// every protocol.
#include "engine/channels/copy_engine/CopyEngineChannel.h"

#include "engine/Error.h"
#include "engine/Peer.h"
#include "engine/channels/copy_engine/ChannelData.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"
#include "engine/channels/copy_engine/CopyEnginePeer.h"

namespace smfree::engine {

CopyEngineChannel::CopyEngineChannel(CudaOps& cudaOps, const ProgressThread& thread,
                                     std::string processKey, size_t ipcCacheSize,
                                     uint64_t stagingBytes, uint64_t eagerBytes,
                                     uint64_t ringMemoryBytes, bool collectiveLanes, Done onDone,
                                     Notify notify, Release release)
    : Channel({Capability::kNotices, Capability::kProgress, Capability::kSweep,
               Capability::kSameHostOnly}),
      context_(cudaOps, thread, ipcCacheSize, ringMemoryBytes, std::move(onDone),
               std::move(notify)),
      direct_(context_),
      staged_(context_, direct_, stagingBytes),
      eager_(context_, eagerBytes),
      collective_(context_, std::move(processKey), ipcCacheSize, collectiveLanes),
      release_(std::move(release)) {}

const std::string& processKeyOf(const Peer& peer) { return peer.address.processKey; }

int pidfdOf(const Peer& peer) { return peer.watch ? peer.watch->fd() : -1; }

std::string describePeer(const Peer& peer) { return peer.describe(); }

std::string CopyEngineChannel::announce(const Op& send) { return eager_.announce(send); }

void CopyEngineChannel::prepareSend(const std::shared_ptr<Op>& send, Peer& destination) {
  eager_.prepareSend(send, destination);
}

void CopyEngineChannel::announced(Peer& source, const ReadyToSend& rts) {
  eager_.announced(source, rts.channelData,
                   LaneKey{source.address.processKey, rts.group, rts.tag}, rts.seq);
}

std::string CopyEngineChannel::armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                                       const std::string& announced) {
  context_.thread().check("CopyEngineChannel::armRecv");
  if (!announced.empty()) return eager_.arm(recv, source, announced);
  const CopyEngineOp& state = copyEngineOp(*recv);
  if (state.collective) {
    collective_.move(recv);
    return {};  // its sender's op knows from its record: the copy is queued
  }
  if (state.eagerRecv && !state.eagerRecv->claimBy(EagerRecv::kByProgress)) {
    fail(recv->describe(), " expected its message in an eager slot, and its sender sent it by "
         "rendezvous (the two sides' sizes differ)");
  }
  const std::string destination = direct_.exportDestination(*recv, source);
  const std::string ring = staged_.ringData(source, *recv);
  // A send that could have gone eagerly did not: its sender may not know the ring yet.
  const std::string eager = eager_.ringData(*recv, source);
  return direct_.arm(recv, source, destination, ring, eager);
}

void CopyEngineChannel::discard(Peer& source, const ReadyToSend& rts, Op* recv) {
  context_.thread().check("CopyEngineChannel::discard");
  if (recv && recv->channelOp && recv->channel == ChannelKind::kCopyEngine) {
    const auto& eagerRecv = copyEngineOp(*recv).eagerRecv;
    // Its wait() queued, or ended() releases, the copy out that empties the slot.
    if (eagerRecv && !eagerRecv->claimBy(EagerRecv::kByProgress)) return;
  }
  eager_.discard(source, rts.channelData, LaneKey{source.address.processKey, rts.group, rts.tag});
}

bool CopyEngineChannel::outlivesWait(const Op& op) const {
  // An eager send's receiver may still need the slot's bytes, which its process's exit would
  // take away; a recv whose wait() queued its copy out ends when the bytes come.
  const CopyEngineOp& state = copyEngineOp(op);
  if (state.collective) return true;  // its wait() returns before its copy is queued, or has run
  if (op.isSend()) return state.eager.has_value();
  return state.eagerRecv && state.eagerRecv->claim.load() == EagerRecv::kByCaller;
}

void CopyEngineChannel::startSend(const std::shared_ptr<Op>& send, Peer& destination,
                                  const std::string& channelData) {
  context_.thread().check("CopyEngineChannel::startSend");
  if (copyEngineOp(*send).eager) {
    eager_.cleared(send);  // its bytes are in the receiver's slot, and the receiver took them
    return;
  }
  if (copyEngineOp(*send).collective) {
    if (!channelData.empty()) {
      fail(send->describe(), " went by a collective lane and its receiver cleared it by "
           "rendezvous (SMFREE_COLLECTIVE_LANES must be alike on every rank)");
    }
    collective_.move(send);
    return;
  }
  if (send->isCollective() && channelData.empty()) {
    fail(send->describe(), " went by rendezvous and its receiver's piece by a collective lane "
         "(SMFREE_COLLECTIVE_LANES must be alike on every rank)");
  }
  ClearanceData read = readClearance(channelData);
  staged_.learn(destination, std::move(read.ring));
  cuda::RemoteFlagSegment& theirs =
      context_.flagsOf(destination.address.processKey, destination.address, pidfdOf(destination));
  eager_.open(*send, destination, std::move(read.eagerRing), theirs);
  staged_.start(ClearedSend{send, &destination, &theirs, read.header,
                            std::move(read.destination)});  // held for a slot, or direct
}

void CopyEngineChannel::cancel(Op& op) {
  context_.thread().check("CopyEngineChannel::cancel");
  if (copyEngineOp(op).collective) {
    CollectiveProtocol::cancel(op);
    return;
  }
  // A recv's sender may still copy: the buffer stays until its `done` word says how it ended.
  if (!op.isSend()) return;
  staged_.cancel(op);
  eager_.cancel(op);
  direct_.cancel(op);
}

void CopyEngineChannel::partnerGaveUp(Op& op) {
  if (copyEngineOp(op).collective) return;  // the copy was queued at a post: it ends as it runs
  // A copy out of a slot, queued, still writes the buffer: it ends as it finishes.
  direct_.partnerGaveUp(op);
}

Progress CopyEngineChannel::progress() {
  context_.thread().check("CopyEngineChannel::progress");
  bool moved = staged_.advanceHeld();
  moved = eager_.emptyHeldSlots() || moved;
  moved = direct_.progress() || moved;
  moved = staged_.progress() || moved;
  moved = eager_.progress() || moved;
  moved = collective_.progress() || moved;
  return Progress{moved};
}

bool CopyEngineChannel::busy() const {
  return direct_.busy() || staged_.busy() || eager_.busy() || collective_.busy();
}

void CopyEngineChannel::peerFailed(Peer& peer) {
  const Status gone = Status::failure(StatusCode::kPeerFailure, peer.failure);
  staged_.peerFailed(peer, gone);
  collective_.peerFailed(peer, gone);
  direct_.peerFailed(peer, gone);
  eager_.peerFailed(peer, gone);
  const std::string& key = peer.address.processKey;
  staged_.dropPeer(key);
  eager_.dropPeer(key);
  context_.ipc().dropPeer(key);
}

void CopyEngineChannel::onNotice(const Notice& notice) {
  if (const auto* n = std::get_if<PeerNotice>(&notice)) {
    onNotice(n->source, n->data);
  } else if (const auto* n = std::get_if<SendAnnounced>(&notice)) {
    announced(n->source, n->rts);
  } else if (const auto* n = std::get_if<SendUnarmed>(&notice)) {
    discard(n->source, n->rts, n->recv);
  } else if (const auto* n = std::get_if<MemoryFreed>(&notice)) {
    onMemoryReleased(n->owner, n->ids);
  }
  // GroupClosed: no admission hook here, so no op of the group is held back.
}

void CopyEngineChannel::onNotice(Peer& source, const std::string& data) {
  staged_.onNotice(source, data);
}

std::string CopyEngineChannel::describeWait(const Op& op) const {
  auto flag = [](const char* name, uint32_t word, const cuda::Flag& wanted) {
    return concat(name, " ", wanted.index, ":", word, "/", wanted.value);
  };
  const cuda::FlagSegment& flags = context_.flags();
  const CopyEngineOp& state = copyEngineOp(op);
  std::string text = "flags " + flag("queued", flags.wordOf(state.queued), state.queued);
  if (state.collective) return text + collective_.describeWait(op);
  if (!op.isSend()) {
    text += concat(", ", flag("ready", flags.wordOf(state.ready), state.ready), ", ",
                   flag("done", flags.wordOf(state.done), state.done.plus(kCopied)));
  } else {
    auto event = [](const char* name, const std::shared_ptr<cuda::Event>& e) {
      return concat(name, " ", e && e->reached() ? "reached" : "pending");
    };
    text += concat(", ", event("produced", state.produced), ", ", event("copied", state.copied));
  }
  return text + staged_.describeWait(op) + eager_.describeWait(op) + direct_.describeWait(op);
}

void CopyEngineChannel::sweep() {
  for (auto& [key, ids] : context_.exporter().sweep()) release_(key, std::move(ids));
  for (auto& [key, ids] : collective_.lanes().sweep()) release_(key, std::move(ids));
}

void CopyEngineChannel::report(ChannelReport& report) const {
  const RingMemory& memory = context_.ringMemory();
  if (memory.taken() != 0) {
    report.memory.push_back(concat("rings for peers' sends: ", memory.describe()));
  }
  std::map<std::string, int64_t>& stats = report.stats;
  stats["ipc_mappings"] = static_cast<int64_t>(context_.ipc().size());
  stats["ipc_exports"] = static_cast<int64_t>(context_.exporter().size());
  staged_.addStats(stats);
  eager_.addStats(stats);
  stats["ring_bytes"] = static_cast<int64_t>(context_.ringMemory().taken());
  collective_.lanes().addStats(stats);
}

}  // namespace smfree::engine
