#include "engine/OpControl.h"

#include <algorithm>
#include <sstream>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/PeerValue.h"

namespace smfree::engine {
namespace {

int64_t millisSince(Clock::time_point then, Clock::time_point now) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - then).count();
}

// What every failure of an op says first: the op, then why.
Status opFailure(const Op& op, StatusCode code, const std::string& why) {
  return Status::failure(code, concat(op.describe(), " failed: ", why));
}

std::string crossHostCuda(const Op& op, const Peer& peer) {
  return concat("rank ", op.partner(), " (", peer.describe(),
                ") is on another host, out of reach of the copy engines "
                "(SMFREE_CHANNEL=copy_engine); use auto or ucx");
}

const char* channelName(ChannelKind kind) {
  switch (kind) {
    case ChannelKind::kCopyEngine:
      return "the copy engines";
    case ChannelKind::kCaptured:
      return "the copy engines inside a CUDA graph";
    case ChannelKind::kLoopback:
      return "a copy within this process";
    case ChannelKind::kUcx:
      break;
  }
  return "UCX";
}

std::string mismatchMessage(const GroupConfig& group, const ReadyToSend& send, const Op& recv) {
  const char* what = send.desc.device != recv.request.desc.device ? "device" : "size or dtype";
  const std::string line =
      send.tag == kCollectiveTag ? std::string("a collective") : concat("tag ", send.tag);
  return concat(what, " mismatch in group '", group.name, "', ", line, ": rank ",
                send.source, " sends ", send.desc.describe(), " to rank ", group.rank,
                ", which receives into ", recv.request.desc.describe());
}

// The moves OpControl::transition() makes: one step forward, or to kEnded from any state
// before it; to kReleased only once no channel holds the buffer.
bool allowed(const Op& op, OpState next) {
  switch (next) {
    case OpState::kPosted:
      return false;
    case OpState::kWaiting:
      return op.state == OpState::kPosted;
    case OpState::kMoving:
      return op.state == OpState::kWaiting;
    case OpState::kEnded:
      return op.state < OpState::kEnded;
    case OpState::kReleased:
      return op.state == OpState::kEnded && op.outstanding == 0;
  }
  return false;
}

// Announcements for groups this process has not joined yet, from all peers together: past it,
// more are dropped (the group they name is not known, nor the peer behind them).
constexpr size_t kMaxOrphans = 1 << 16;

}  // namespace

OpControl::OpControl(Channels& channels, PeerLinks& peers, Failures& failures,
                     const ProgressThread& thread)
    : channels_(channels), peers_(peers), failures_(failures), thread_(thread) {}

void OpControl::shutDown() {
  thread_.check("OpControl::shutDown");
  std::vector<std::shared_ptr<Op>> left;
  for (const auto& [id, op] : live_) left.push_back(op);
  for (const std::shared_ptr<Op>& op : left) {
    const std::string why = concat(op->describe(), " failed: the smfree engine shut down");
    failOp(op, StatusCode::kAborted, why);
  }
  live_.clear();
  groups_.clear();
}

void OpControl::registerGroup(std::shared_ptr<const GroupConfig> config) {
  thread_.check("OpControl::registerGroup");
  const uint64_t id = groupIdOf(config->name);
  auto existing = groups_.find(id);
  if (existing != groups_.end() && !existing->second.closed) {
    fail("group '", config->name, "' is already open in this process (or its name hashes like "
         "group '", existing->second.config->name, "')");
  }
  failures_.forgetAfterWait(id);  // of a closed group of the same name
  GroupState& state = groups_[id];
  state = GroupState{};
  state.config = config;
  state.id = id;
  state.peers.assign(config->size, nullptr);
  auto orphans = orphans_.find(id);
  if (orphans != orphans_.end()) {
    for (ReadyToSend& rts : orphans->second) {
      // No recv is posted yet: nothing can match.
      if (rankInGroup(state, rts)) announceOrFail(state, std::move(rts));
    }
    orphanCount_ -= orphans->second.size();
    orphans_.erase(orphans);
  }
}

void OpControl::closeGroup(uint64_t groupId, StatusCode code, const std::string& reason) {
  thread_.check("OpControl::closeGroup");
  GroupState* group = findGroup(groupId);
  if (!group || group->closed) {
    return;
  }
  group->closed = true;
  group->closeReason = reason;
  std::vector<std::shared_ptr<Op>> affected;
  for (auto& [id, op] : live_) {
    if (op->groupId == groupId && !op->finished()) affected.push_back(op);
  }
  for (auto& op : affected) {
    const bool moving = op->state == OpState::kMoving;
    failOp(op, code, concat(op->describe(), " failed: ", reason));
    if (moving) op->channelOp->cancel(*op, Cancel::kFailed);
  }
  for (Matcher* matcher : {&group->matcher, &group->capturedMatcher}) {
    matcher->forEachWaiting(
        [&](const Announcement& announcement) { discardAnnounced(*group, announcement.rts); });
    matcher->clear();
  }
  // And the group's ops that an admission hook holds back.
  channels_.forEach(Capability::kNotices, [&](Channel& channel) {
    channel.onNotice(GroupClosed{groupId, code, reason});
  });
}

size_t OpControl::releasedOpsInFlight(std::optional<uint64_t> groupId) {
  thread_.check("OpControl::releasedOpsInFlight");
  size_t count = 0;
  for (const auto& [id, op] : live_) {
    if (groupId && op->groupId != *groupId) continue;
    if (!op->finished() && op->channelOp->outlivesWait(*op)) ++count;
  }
  return count;
}

std::string OpControl::dumpPending(uint64_t groupId) {
  thread_.check("OpControl::dumpPending");
  const auto now = Clock::now();
  std::ostringstream out;
  size_t count = 0;
  for (const auto& [id, op] : live_) {
    if (op->groupId != groupId || op->finished()) continue;
    ++count;
    out << "  " << op->describe() << ", posted " << millisSince(op->posted, now) << " ms ago, "
        << (op->state == OpState::kMoving
                ? "moving data"
                : (op->isSend() ? "waiting for the receiver" : "waiting for a matching send"));
    if (const std::string wait = op->channelOp->describe(*op); !wait.empty()) {
      out << " [" << wait << "]";
    }
    out << "\n";
  }
  if (GroupState* group = findGroup(groupId)) {
    for (const Matcher* matcher : {&group->matcher, &group->capturedMatcher}) {
      matcher->forEachWaiting([&](const Announcement& announcement) {
        ++count;
        out << "  announced " << (matcher == &group->capturedMatcher ? "captured " : "")
            << "send from rank " << announcement.rts.source << " (tag " << announcement.rts.tag
            << ", " << announcement.rts.desc.describe() << "), waiting for a recv"
            << (announcement.cancelled ? " (cancelled by sender)" : "") << "\n";
      });
    }
  }
  ChannelReport report;
  channels_.forEach([&](const Channel& channel) { channel.report(report); });
  for (const std::string& memory : report.memory) out << "  " << memory << "\n";
  return concat(count, " pending:\n", out.str());
}

std::optional<Status> OpControl::refusalAtStart(const Op& op, const GroupState* group) {
  if (!group || group->closed) return opFailure(op, StatusCode::kAborted, "the group is closed");
  // A recv from any source waits for whichever peer; an op to the rank itself has none.
  if (op.request.peer == kAnySource || op.channelOp->traits().withinProcess) {
    return std::nullopt;
  }
  const Peer* peer = group->peers[op.request.peer];
  if (!peer || peer->failed) {
    return opFailure(op, StatusCode::kPeerFailure,
                     peer ? peer->failure : "the peer is not connected");
  }
  if (!channels_.of(op).reaches(*peer)) {
    return opFailure(op, StatusCode::kChannel, crossHostCuda(op, *peer));
  }
  return std::nullopt;
}

void OpControl::startOp(const std::shared_ptr<Op>& op) {
  thread_.check("OpControl::startOp");
  // A channel may hold the op back (UCX's commitments); it starts it here again later.
  if (!channels_.admit(op)) return;
  GroupState* group = findGroup(op->groupId);
  if (const auto refusal = refusalAtStart(*op, group)) {
    transition(op, OpState::kEnded, *refusal);
    keepPlace(op, group, refusal->message);
    return;
  }
  live_.emplace(op->id, op);
  // A caller may wait on this thread for it (a rendezvous's wait()): the loop keeps polling.
  op->awaitsProgress = !op->channelOp->traits().returnsAtOnce;
  if (op->awaitsProgress) ++awaitingProgress_;
  transition(op, OpState::kWaiting);
  if (op->channelOp->traits().withinProcess) {
    // Paired at its post, with no message to send: its channel ends it now that it started.
    if (!op->isSend()) op->source = op->request.peer;
    return;
  }
  if (op->isSend()) {
    Peer& peer = *group->peers[op->request.peer];
    ChannelAnnouncement announcement;
    try {
      announcement = op->channelOp->announce(op, peer);
    } catch (const Error& error) {
      // Announced all the same, and cancelled: its receiver's line keeps its place.
      failOp(op, StatusCode::kChannel, error.what());
      keepPlace(op, group, error.what());
      return;
    }
    peers_.send(peer, ReadyToSend{op->groupId, group->config->rank, op->request.tag, op->seq,
                                  op->id, op->request.desc, op->channel, announcement.promised,
                                  std::move(announcement.channelData)});
    return;
  }
  if (auto match = group->matcherFor(op->channel).postRecv(op)) {
    onMatched(*group, *match);
  }
}

void OpControl::onReadyToSend(const ReadyToSend& message) {
  thread_.check("OpControl::onReadyToSend");
  GroupState* group = findGroup(message.group);
  if (!group) {
    if (orphanCount_ >= kMaxOrphans) {
      logOnce("orphans", concat("dropped announcements for groups this process has not joined: "
                                "more than ", kMaxOrphans, " wait"),
              LogLevel::kError);
      return;
    }
    orphans_[message.group].push_back(message);
    ++orphanCount_;
    return;
  }
  if (group->closed) {
    log(LogLevel::kDebug, "dropped a send announced to closed group '", group->config->name, "'");
    discardAnnounced(*group, message);
    return;
  }
  if (!rankInGroup(*group, message)) return;
  Peer* sender = group->peers[message.source];
  if (sender && !message.channelData.empty()) {
    channels_.notify(message.channel, SendAnnounced{*sender, message});
  }
  announceOrFail(*group, message);
}

bool OpControl::rankInGroup(const GroupState& group, const ReadyToSend& message) {
  try {
    checkBelow(message.kName, "source rank", message.source, group.peers.size());
    return true;
  } catch (const BadPeerValue& error) {
    // No peer to blame: the rank that would name it is the bad value.
    log(LogLevel::kError, "dropped a control message in group '", group.config->name, "': ",
        reasonOf(error));
    return false;
  }
}

void OpControl::announceOrFail(GroupState& group, ReadyToSend message) {
  std::vector<Matcher::Match> matches;
  try {
    matches = group.matcherFor(message.channel).announce(message);
  } catch (const BadPeerValue& error) {
    discardAnnounced(group, message);
    // Not connected yet (its first op with this process is to come): nothing of it to fail.
    if (Peer* sender = group.peers[message.source]) {
      badValueFrom(*sender, error);
    } else {
      log(LogLevel::kError, "dropped a send announced by rank ", message.source, ": ",
          reasonOf(error));
    }
    return;
  }
  for (Matcher::Match& match : matches) onMatched(group, match);
}

Peer* OpControl::replier(uint64_t groupId, const char* message, int rank) {
  GroupState* group = findGroup(groupId);
  if (!group) return nullptr;  // closed and forgotten, or never joined: nothing to act on
  try {
    checkBelow(message, "receiver rank", rank, group->peers.size());
  } catch (const BadPeerValue& error) {
    log(LogLevel::kError, "dropped a control message in group '", group->config->name, "': ",
        reasonOf(error));
    return nullptr;
  }
  return group->peers[rank];
}

void OpControl::badValueFrom(Peer& peer, const BadPeerValue& error) {
  // "its peer process (pid 4242 on host n1) sent a bad ready flag index in a ...: ..."
  const std::string why = concat("its peer process (", peer.describe(), ") sent a ",
                                 reasonOf(error));
  log(LogLevel::kError, why);
  failOpsWith(peer, StatusCode::kChannel, why);
}

void OpControl::failOpsWith(Peer& peer, StatusCode code, const std::string& why) {
  std::vector<std::shared_ptr<Op>> affected;
  for (auto& [id, op] : live_) {
    if (!op->finished() && partnerOf(*op) == &peer) affected.push_back(op);
  }
  for (auto& op : affected) {
    const bool moving = op->state == OpState::kMoving;
    failOp(op, code, concat(op->describe(), " failed: ", why));
    if (moving) op->channelOp->cancel(*op, Cancel::kFailed);
  }
}

bool OpControl::isOwnOp(const Op& op, uint64_t groupId, int partner, OpKind kind) {
  return op.request.kind == kind && op.groupId == groupId && op.partner() == partner;
}

std::optional<OpControl::MatchRefusal> OpControl::refusalOfMatch(const GroupState& group,
                                                                   const Matcher::Match& match,
                                                                   const Peer& sender) {
  const Op& recv = *match.recv;
  const ReadyToSend& rts = match.announcement.rts;
  const bool compatible = rts.desc.compatibleWith(recv.request.desc);
  if (!channels_.of(recv).reaches(sender) && compatible) {
    return MatchRefusal{opFailure(recv, StatusCode::kChannel, crossHostCuda(recv, sender)), true};
  }
  if (match.announcement.cancelled) {
    return MatchRefusal{Status::failure(StatusCode::kTimeout,
                                        concat(recv.describe(),
                                               " failed: the matching send gave up: ",
                                               match.announcement.cancelReason)),
                        false};
  }
  if (!compatible) {
    return MatchRefusal{
        Status::failure(StatusCode::kMismatch, mismatchMessage(*group.config, rts, recv)), true};
  }
  if (rts.desc.bytes != 0 && rts.channel != recv.channel) {
    const std::string why =
        concat("channel mismatch in group '", group.config->name, "', tag ", rts.tag, ": rank ",
               rts.source, " sends ", rts.desc.describe(), " over ", channelName(rts.channel),
               ", rank ", group.config->rank, " receives into ", recv.request.desc.describe(),
               " over ", channelName(recv.channel),
               " (SMFREE_CHANNEL must be alike on every rank)");
    return MatchRefusal{Status::failure(StatusCode::kMismatch, why), true};
  }
  return std::nullopt;
}

void OpControl::onMatched(GroupState& group, Matcher::Match& match) {
  const std::shared_ptr<Op>& recv = match.recv;
  const ReadyToSend& rts = match.announcement.rts;
  Peer* sender = group.peers[rts.source];
  if (!sender) {
    // Cannot happen for a specific recv (it connects first); any-source recvs connect to all.
    failOp(recv, StatusCode::kChannel,
           concat(recv->describe(), " matched rank ", rts.source,
                  ", which it is not connected to"));
    return;
  }
  if (recv->finished()) {
    // The recv failed earlier (timed out, or refused at its start) but kept its place in
    // line: refuse the send it was meant for.
    discardAnnounced(group, rts, recv.get());
    peers_.send(*sender, Refusal{group.id, group.config->rank, rts.sendId, StatusCode::kTimeout,
                                 concat("the matching ", recv->describe(),
                                        " had already failed")});
    return;
  }
  recv->source = rts.source;
  if (recv->request.onMatched) recv->request.onMatched(rts.source);
  if (const auto refusal = refusalOfMatch(group, match, *sender)) {
    discardAnnounced(group, rts, recv.get());
    transition(recv, OpState::kEnded, refusal->status);
    if (refusal->tellSender) {
      peers_.send(*sender, Refusal{group.id, group.config->rank, rts.sendId, refusal->status.code,
                                   refusal->status.message});
    }
    return;
  }
  ClearToSend clear{group.id, group.config->rank, rts.sendId, recv->id, {}};
  if (rts.desc.bytes == 0) {
    discardAnnounced(group, rts, recv.get());
    transition(recv, OpState::kEnded, Status::success());
    peers_.send(*sender, clear);
    return;
  }
  transition(recv, OpState::kMoving);
  try {
    clear.channelData = recv->channelOp->arm(recv, *sender, rts.channelData);
  } catch (const BadPeerValue& error) {
    discardAnnounced(group, rts, recv.get());
    badValueFrom(*sender, error);  // the recv with the others of that peer
    peers_.send(*sender, Refusal{group.id, group.config->rank, rts.sendId,
                                 StatusCode::kChannel, error.what()});
    return;
  } catch (const Error& error) {
    discardAnnounced(group, rts, recv.get());
    failOp(recv, StatusCode::kChannel, error.what());
    peers_.send(*sender, Refusal{group.id, group.config->rank, rts.sendId,
                                 StatusCode::kChannel, error.what()});
    return;
  }
  peers_.send(*sender, clear);
  recv->channelOp->start(recv, *sender, {}, rts.promised);
}

void OpControl::onClearToSend(const ClearToSend& message) {
  thread_.check("OpControl::onClearToSend");
  Peer* receiver = replier(message.group, message.kName, message.receiver);
  if (!receiver) return;
  GroupState* group = findGroup(message.group);
  std::shared_ptr<Op> send = findLive(message.sendId);
  if (send && !isOwnOp(*send, message.group, message.receiver, OpKind::kSend)) {
    // An op id only this process hands out, echoed for another op: not to be acted on.
    badValueFrom(*receiver, BadPeerValue("send id", concat("smfree: bad send id in a ",
                 message.kName, ": op ", message.sendId, " is not a send of this group to rank ",
                 message.receiver)));
    return;
  }
  if (!send || send->finished()) {
    // The send already failed (timeout, abort): its receiver must not wait for the bytes.
    if (message.recvId != 0) {
      peers_.send(*receiver,
                  Cancellation{message.group, group->config->rank, 0, 0, message.recvId,
                               send ? concat("the matching send gave up: ", send->describe(),
                                             " had already failed")
                                    : concat("the matching send gave up: rank ",
                                             group->config->rank, " had already failed it")});
    }
    return;
  }
  if (send->request.desc.bytes == 0) {
    transition(send, OpState::kEnded, Status::success());
    return;
  }
  if (receiver->failed) {
    failOp(send, StatusCode::kPeerFailure,
           concat(send->describe(), " failed: ", receiver->failure));
    return;
  }
  transition(send, OpState::kMoving);
  try {
    if (const auto gone = send->request.bufferCheck ? send->request.bufferCheck() : std::nullopt) {
      throw Error(concat(send->describe(), " failed: ", *gone));
    }
    send->channelOp->start(send, *receiver, message.channelData, false);
  } catch (const BadPeerValue& error) {
    badValueFrom(*receiver, error);  // the send with the others of that peer
    peers_.send(*receiver, Cancellation{message.group, group->config->rank, 0, 0, message.recvId,
                                        concat("the matching send refused its clear-to-send: ",
                                               reasonOf(error))});
  } catch (const Error& error) {
    failOp(send, StatusCode::kChannel, error.what());
    // Its receiver is armed for bytes that will not come: it fails now, not at its timeout.
    peers_.send(*receiver, Cancellation{message.group, group->config->rank, 0, 0, message.recvId,
                                        concat("the matching send failed: ", error.what())});
  }
}

void OpControl::onRefusal(const Refusal& message) {
  thread_.check("OpControl::onRefusal");
  Peer* receiver = replier(message.group, message.kName, message.receiver);
  if (!receiver) return;
  std::shared_ptr<Op> send = findLive(message.sendId);
  if (!send) return;
  if (!isOwnOp(*send, message.group, message.receiver, OpKind::kSend)) {
    badValueFrom(*receiver, BadPeerValue("send id", concat("smfree: bad send id in a ",
                 message.kName, ": op ", message.sendId, " is not a send of this group to rank ",
                 message.receiver)));
    return;
  }
  failOp(send, message.code, message.reason);
}

void OpControl::onCancellation(const Cancellation& message) {
  thread_.check("OpControl::onCancellation");
  if (message.recvId != 0) {
    std::shared_ptr<Op> recv = findLive(message.recvId);
    if (!recv) {
      return;
    }
    if (!isOwnOp(*recv, message.group, message.source, OpKind::kRecv)) {
      if (Peer* sender = peerOf(message.group, message.source)) {
        badValueFrom(*sender, BadPeerValue("recv id", concat("smfree: bad recv id in a ",
                     message.kName, ": op ", message.recvId,
                     " is not a recv of this group matched with rank ", message.source)));
      }
      return;
    }
    // Also for a recv that already failed (timed out, group closed): its channel may still
    // hold the buffer for bytes that will now never come.
    const bool armed = recv->outstanding > 0;
    failOp(recv, StatusCode::kTimeout, concat(recv->describe(), " failed: ", message.reason));
    if (armed) recv->channelOp->cancel(*recv, Cancel::kPartnerGaveUp);
    return;
  }
  if (GroupState* group = findGroup(message.group)) {
    group->matcherFor(message.channel).cancel(message.source, message.tag, message.seq,
                                              message.reason);
  }
}

void OpControl::onTransferDone(const std::shared_ptr<Op>& op, const Status& status) {
  thread_.check("OpControl::onTransferDone");
  transition(op, OpState::kEnded, status);
  transition(op, OpState::kReleased);
}

void OpControl::peerFailed(Peer& peer, const std::string& why) {
  thread_.check("OpControl::peerFailed");
  bool waiting = false;
  for (auto& [id, op] : live_) waiting = waiting || (!op->finished() && partnerOf(*op) == &peer);
  // A peer leaving after every group with it closed is a normal exit.
  const bool matters = waiting || referencedByOpenGroup(peer);
  log(matters ? LogLevel::kWarn : LogLevel::kDebug, "peer ", peer.describe(), " failed: ", why);
  failOpsWith(peer, StatusCode::kPeerFailure, peer.failure);
}

void OpControl::expireOps(Clock::time_point now) {
  thread_.check("OpControl::expireOps");
  std::vector<std::shared_ptr<Op>> expired;
  for (auto& [id, op] : live_) {
    if (!op->finished() && now >= op->deadline) expired.push_back(op);
  }
  std::vector<uint64_t> reported;
  for (auto& op : expired) {
    if (std::find(reported.begin(), reported.end(), op->groupId) == reported.end()) {
      reported.push_back(op->groupId);
      log(LogLevel::kWarn, "timeout in group '", op->config->name, "'; ",
          dumpPending(op->groupId));
    }
    expire(op, now);
  }
}

void OpControl::probeSilentPeers(Clock::time_point now) {
  thread_.check("OpControl::probeSilentPeers");
  for (const auto& [id, op] : live_) {
    if (op->finished()) continue;
    if (Peer* peer = partnerOf(*op)) peers_.probeIfSilent(*peer, now);
  }
}

Peer* OpControl::peerOf(uint64_t groupId, int rank) {
  GroupState* group = findGroup(groupId);
  if (!group || rank < 0 || rank >= static_cast<int>(group->peers.size())) return nullptr;
  return group->peers[rank];
}

std::string OpControl::timeoutMessage(const Op& op, Clock::time_point now) {
  const int64_t age = millisSince(op.posted, now);
  const int64_t limit = millisSince(op.posted, op.deadline);
  const bool moving = op.state == OpState::kMoving;
  const Peer* peer = partnerOf(op);
  if (const auto silent = peer ? peers_.silence(*peer, now) : std::nullopt) {
    // Say what was seen, rather than blame the program for what did not happen.
    const char* state = moving ? "its bytes moving"
                               : (op.isSend() ? "waiting for its recv" : "waiting for its send");
    return concat(op.describe(), " failed at the group timeout of ", limit, " ms (posted ", age,
                  " ms ago, ", state, "): ", *silent);
  }
  const char* unmatched = op.isSend() ? " was not matched by a recv" : " was not matched by a send";
  return concat(op.describe(), moving ? " did not finish" : unmatched,
                " within the group timeout of ", limit, " ms (posted ", age, " ms ago)");
}

void OpControl::expire(const std::shared_ptr<Op>& op, Clock::time_point now) {
  const bool moving = op->state == OpState::kMoving;
  const std::string why = timeoutMessage(*op, now);
  failOp(op, StatusCode::kTimeout, why);
  if (moving) {
    op->channelOp->cancel(*op, Cancel::kFailed);
  }
  // An announced send still holds a place in the receiver's line: tell it the send gave up.
  if (op->isSend() && !moving) {
    if (Peer* peer = partnerOf(*op); peer && !peer->failed) {
      peers_.send(*peer, Cancellation{op->groupId, op->config->rank, op->request.tag, op->seq, 0,
                                      why, op->channel});
    }
  }
}

void OpControl::failOp(const std::shared_ptr<Op>& op, StatusCode code, std::string why) {
  transition(op, OpState::kEnded, Status::failure(code, std::move(why)));
}

bool OpControl::transition(const std::shared_ptr<Op>& op, OpState next, const Status& status) {
  if (!allowed(*op, next)) {
    return false;
  }
  op->state = next;
  if (next == OpState::kEnded) {
    OpCallback callback = std::move(op->request.onComplete);
    op->request.onComplete = nullptr;
    if (callback) {
      try {
        callback(status, op->source);
      } catch (const std::exception& error) {
        log(LogLevel::kError, "completion callback of ", op->describe(), " threw: ", error.what());
      }
    }
    // After the callback, so a caller whose stream wait the channel releases sees the error.
    op->channelOp->end(*op, status);
    transition(op, OpState::kReleased);
  } else if (next == OpState::kReleased) {
    op->request.keepalive.reset();
    op->channelOp->release(*op);
    live_.erase(op->id);
    if (op->awaitsProgress) --awaitingProgress_;
  }
  return true;
}

void OpControl::discardAnnounced(GroupState& group, const ReadyToSend& rts, Op* recv) {
  if (rts.channelData.empty()) return;
  Peer* sender = rts.source >= 0 && rts.source < static_cast<int>(group.peers.size())
                     ? group.peers[rts.source]
                     : nullptr;
  // A failed sender's channel state is gone with it.
  if (sender && !sender->failed) {
    channels_.notify(rts.channel, SendUnarmed{*sender, rts, recv});
  }
}

void OpControl::keepPlace(const std::shared_ptr<Op>& op, GroupState* group,
                           const std::string& why) {
  // The op was numbered in its line at its post. Where the partner can still be told, it keeps
  // that place, as one that timed out does, so later messages of the line are not shifted: a
  // send is announced and cancelled; a recv waits in the matcher, already failed, and refuses
  // the send it meets.
  if (!group || group->closed || op->request.peer == kAnySource) return;
  Peer* peer = group->peers[op->request.peer];
  if (!peer || peer->failed) return;
  if (op->isSend()) {
    peers_.send(*peer, ReadyToSend{op->groupId, group->config->rank, op->request.tag, op->seq,
                                   op->id, op->request.desc, op->channel, false, {}});
    peers_.send(*peer, Cancellation{op->groupId, group->config->rank, op->request.tag, op->seq,
                                    0, why, op->channel});
  } else if (auto match = group->matcherFor(op->channel).postRecv(op)) {
    onMatched(*group, *match);
  }
}

GroupState* OpControl::findGroup(uint64_t groupId) {
  auto it = groups_.find(groupId);
  return it == groups_.end() ? nullptr : &it->second;
}

std::shared_ptr<Op> OpControl::findLive(uint64_t opId) {
  auto it = live_.find(opId);
  return it == live_.end() ? nullptr : it->second;
}

Peer* OpControl::partnerOf(const Op& op) { return peerOf(op.groupId, op.partner()); }

bool OpControl::referencedByOpenGroup(const Peer& peer) const {
  for (const auto& [id, group] : groups_) {
    if (group.closed) continue;
    for (const Peer* member : group.peers) {
      if (member == &peer) return true;
    }
  }
  return false;
}

}  // namespace smfree::engine
