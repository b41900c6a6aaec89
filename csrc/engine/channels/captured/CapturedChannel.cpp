#include "engine/channels/captured/CapturedChannel.h"

#include <unistd.h>

#include <algorithm>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Peer.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {

void CapturedChannel::Graveyard::bury(std::shared_ptr<CapturedOp> op) {
  std::lock_guard<std::mutex> lock(mutex);
  if (open) {
    buried.push_back(std::move(op));
    return;
  }
  // The engine is gone, and with it the flag segment the op's words are of: the process's
  // end frees the rest.
  new std::shared_ptr<CapturedOp>(std::move(op));
}

CapturedChannel::CapturedChannel(CudaOps& cudaOps, const ProgressThread& thread,
                                 Failures& failures, Done onDone, Notify notify)
    : Channel({Capability::kNotices, Capability::kProgress, Capability::kSweep,
               Capability::kSameHostOnly}),
      thread_(thread),
      failures_(failures),
      flags_(cudaOps.flags()),
      onDone_(std::move(onDone)),
      notify_(std::move(notify)) {}

CapturedChannel::~CapturedChannel() {
  std::vector<std::shared_ptr<CapturedOp>> buried;
  {
    std::lock_guard<std::mutex> lock(graveyard_->mutex);
    graveyard_->open = false;
    buried.swap(graveyard_->buried);
  }
}

std::string CapturedChannel::announce(const Op& send) {
  const CapturedOp& op = capturedOf(send);
  if (op.buffer.bytes == 0) return {};  // nothing to say
  CapturedAnnouncement announced{op.way, {}};
  if (op.way == CapturedWay::kSlot) {
    announced.slot = CapturedSlot{op.full->get(), op.empty->get(), op.slot->exportIpc()};
  }
  std::string data;
  announced.appendTo(data);
  return data;
}

std::shared_ptr<cuda::RemoteFlagSegment> CapturedChannel::wordsOf(const Peer& peer) {
  auto& words = peerWords_[peer.address.processKey];
  if (!words) {
    words = std::make_shared<cuda::RemoteFlagSegment>(
        peer.watch ? peer.watch->fd() : -1, peer.address.flagSegment, peer.describe());
  }
  return words;
}

std::string CapturedChannel::armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                                     const std::string& announced) {
  thread_.check("CapturedChannel::armRecv");
  CapturedOp& op = capturedOf(*recv);
  CapturedAnnouncement announcement = CapturedAnnouncement::read(announced);
  if (announcement.way == CapturedWay::kDirect) {
    if (!op.arrived) {
      fail(recv->describe(), " matched a send that copies straight into its buffer, which "
           "this recv did not tell its sender");
    }
    op.way = CapturedWay::kDirect;
    op.phase.store(CapturedOp::Phase::kMatched, std::memory_order_release);
    return {};
  }
  const std::shared_ptr<cuda::RemoteFlagSegment> words = wordsOf(source);
  cuda::ContextGuard context(op.buffer.device);
  words->cudaAddress(0);  // registered here, once: callers' threads only read its addresses
  const int ownerPidfd = source.watch ? source.watch->fd() : -1;
  CapturedSlot& slot = announcement.slot;
  op.sourceSlot = std::make_unique<cuda::PeerMapping>(slot.memory, ownerPidfd, op.buffer.device);
  op.source = std::move(slot);
  op.sourceWords = words;
  op.phase.store(CapturedOp::Phase::kMatched, std::memory_order_release);
  return {};
}

Progress CapturedChannel::progress() {
  std::vector<std::pair<std::string, std::string>> notices;
  {
    std::lock_guard<std::mutex> lock(outboxMutex_);
    notices.swap(outbox_);
  }
  for (auto& [peer, data] : notices) notify_(peer, std::move(data));
  return Progress{!notices.empty()};
}

void CapturedChannel::onNotice(const Notice& notice) {
  thread_.check("CapturedChannel::onNotice");
  const auto* posted = std::get_if<PeerNotice>(&notice);
  if (!posted) return;  // its announcements hold nothing to give back
  Peer& source = posted->source;
  const std::string& data = posted->data;
  PostedRecvs::Entry entry;
  entry.recv = PostedRecv::read(data);  // a bad one fails the peer's ops (Engine)
  if (source.watch) {
    const int pidfd = ::dup(source.watch->fd());
    if (pidfd >= 0) entry.ownerPidfd = std::make_shared<cuda::OwnedFd>(pidfd);
  }
  entry.words = wordsOf(source);
  postedRecvs_.add(source.address.processKey, std::move(entry));
}

void CapturedChannel::ended(Op& op, const Status& status) {
  CapturedOp& captured = capturedOf(op);
  if (status.ok()) {
    // A recv of 0 B ends at its match, with nothing to queue.
    if (captured.phase.load() == CapturedOp::Phase::kPosted) {
      captured.phase = CapturedOp::Phase::kQueued;
    }
    return;
  }
  captured.broken = status.message;
  if (captured.phase.load() == CapturedOp::Phase::kPosted) {
    captured.phase = CapturedOp::Phase::kFailed;
  }
}

void CapturedChannel::peerFailed(Peer& peer) {
  postedRecvs_.dropPeer(peer.address.processKey);
  adoptCaptured();
  for (const auto& op : watched_) {
    if (op->peerKey != peer.address.processKey || op->broken) continue;
    op->broken = concat(op->what, " failed at a replay of its CUDA graph: ", peer.failure,
                        "; its waits are released from now on, and the bytes its graph moves "
                        "are wrong");
  }
}

void CapturedChannel::adoptCaptured() {
  std::lock_guard<std::mutex> lock(capturedMutex_);
  for (auto& op : captured_) {
    if (op->watch) watched_.push_back(std::move(op));  // 0 B ops put no wait in their graph
  }
  captured_.clear();
}

void CapturedChannel::buryDestroyed() {
  std::vector<std::shared_ptr<CapturedOp>> buried;
  {
    std::lock_guard<std::mutex> lock(graveyard_->mutex);
    buried.swap(graveyard_->buried);
  }
  if (buried.empty()) return;
  watched_.erase(std::remove_if(watched_.begin(), watched_.end(),
                                [&](const std::shared_ptr<CapturedOp>& op) {
                                  return std::find(buried.begin(), buried.end(), op) !=
                                         buried.end();
                                }),
                 watched_.end());
  // `buried` goes here: what the ops' graphs used is freed on this thread.
}

void CapturedChannel::sweep() {
  adoptCaptured();
  buryDestroyed();
  {
    // Closes what it kept of freed buffers; their importers' mappings end with their graphs.
    std::lock_guard<std::mutex> lock(exportMutex_);
    exporter_.sweep();
  }
  const auto now = GraphWait::Clock::now();
  for (const auto& op : watched_) {
    if (op->phase.load() != CapturedOp::Phase::kQueued) continue;  // no node in a graph yet
    if (op->broken) {
      // A replay waiting here now is one that cannot end well: the group hears of it.
      if (op->watch->waiting()) failures_.recordAfterWait(op->groupId, *op->broken);
      release(*op);
      continue;
    }
    if (op->watch->check(now, op->timeout) == GraphWait::Verdict::kStuck) {
      breakGroup(op->groupId, stuck(*op));
    }
  }
}

std::string CapturedChannel::stuck(const CapturedOp& op) {
  return concat(op.what, " failed at a replay of its CUDA graph: it waited the group timeout of ",
                op.timeout.count(), " ms for rank ", op.peerRank, "'s graph to ",
                !op.isSend                        ? "send this replay's bytes"
                : op.way == CapturedWay::kDirect ? "reach the recv of this replay's bytes"
                                                  : "take the bytes of its previous replay",
                " (does that rank replay its graph as often?); its waits are released from now "
                "on, and the bytes its graph moves are wrong");
}

void CapturedChannel::breakGroup(uint64_t groupId, const std::string& why) {
  log(LogLevel::kError, why);
  failures_.recordAfterWait(groupId, why);
  for (const auto& op : watched_) {
    if (op->groupId != groupId || op->broken) continue;
    op->broken = why;
    if (op->phase.load() == CapturedOp::Phase::kQueued) release(*op);
  }
}

void CapturedChannel::release(const CapturedOp& op) {
  // The handshake's words go from 0 to 1: raising one never lowers what a GPU wrote.
  const bool direct = op.way == CapturedWay::kDirect;
  if (op.isSend && direct) {
    op.receiverWords->set(cuda::Flag{op.receiverReady.index, 1});
  } else if (op.isSend) {
    flags_.set(cuda::Flag{op.empty->get().index, 1});
  } else if (direct) {
    flags_.set(cuda::Flag{op.arrived->get().index, 1});
  } else {
    op.sourceWords->set(cuda::Flag{op.source.full.index, 1});
  }
}

void CapturedChannel::stop() {
  adoptCaptured();
  for (const auto& op : watched_) {
    if (!op->broken) op->broken = "the process is exiting";
    if (op->phase.load() == CapturedOp::Phase::kQueued) release(*op);
  }
}

CapturedChannelOp::CapturedChannelOp(CapturedChannel& channel, std::shared_ptr<CapturedOp> op)
    : ChannelOp(OpTraits{.callsCudaOnProgressThread = true}),
      channel_(channel),
      op_(std::move(op)) {}

ChannelAnnouncement CapturedChannelOp::announce(const std::shared_ptr<Op>& send, Peer&) {
  return ChannelAnnouncement{.channelData = channel_.announce(*send)};
}

std::string CapturedChannelOp::arm(const std::shared_ptr<Op>& recv, Peer& source,
                               const std::string& announced) {
  return channel_.armRecv(recv, source, announced);
}

void CapturedChannelOp::start(const std::shared_ptr<Op>& op, Peer&, const std::string&, bool) {
  // A send's recv matched it, a recv's clear-to-send left: the rest is the graph's.
  channel_.onDone_(op, Status::success());
}

void CapturedChannelOp::end(Op& op, const Status& status) { channel_.ended(op, status); }

std::string CapturedChannelOp::describe(const Op& op) const {
  return op_->isSend ? "captured: its recv is to be captured"
                     : "captured: its send is to be captured";
}

void CapturedChannel::report(ChannelReport& report) const {
  std::map<std::string, int64_t>& stats = report.stats;
  std::vector<std::shared_ptr<CapturedOp>> ops = watched_;
  {
    std::lock_guard<std::mutex> lock(capturedMutex_);
    ops.insert(ops.end(), captured_.begin(), captured_.end());
  }
  int64_t slots = 0;
  int64_t slotBytes = 0;
  for (const auto& op : ops) {
    if (!op->slot) continue;
    ++slots;
    slotBytes += static_cast<int64_t>(op->slot->bytes());
  }
  stats["captured_ops"] = static_cast<int64_t>(ops.size());
  stats["captured_direct_sends"] = directSends_.load(std::memory_order_relaxed);
  stats["captured_slots"] = slots;
  stats["captured_slot_bytes"] = slotBytes;
}

}  // namespace smfree::engine
