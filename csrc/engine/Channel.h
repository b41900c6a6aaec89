#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "engine/CudaFence.h"
#include "engine/Op.h"
#include "engine/PeerRoute.h"
#include "engine/Status.h"

namespace smfree::engine {

struct Peer;
struct PeerAddress;

// What the caller's thread knows when it posts an op.
struct PostOptions {
  std::chrono::milliseconds timeout;  // the group's: how long admission may block
  PeerRoute route;                    // toward the op's peer; default for any-source recvs
  std::string peerKey;                // the peer's process key; empty for any-source recvs
  // Recvs: Op::seq is the recv's place in its (source, tag) line, which the n-th send of that
  // line meets; false where that cannot be known at the post.
  bool placeKnown = false;
  // The peer's address, held by its group once connected; null for any-source recvs.
  const PeerAddress* peer = nullptr;
};

// What a channel fixes about an op at its post, read by the engine (and by any channel's
// admission hook) without asking the channel.
struct OpTraits {
  // The progress thread makes CUDA calls for the op (Channel::admit).
  bool callsCudaOnProgressThread = false;
  // Its caller's wait() returns without waiting for the progress thread (an eager send, a
  // collective lane's piece): the loop does not poll for it.
  bool returnsAtOnce = false;
  // OpFence::queuedByWait.
  bool queuedByWait = false;
  // Its partner is in this process (an op to the rank itself): the channel paired it at its
  // post, so it has no peer, sends no message and is never armed; the channel ends it through
  // Done once it has started.
  bool withinProcess = false;
};

// A sender's announcement, as its channel makes it (ReadyToSend::promised, ::channelData).
struct ChannelAnnouncement {
  bool promised = false;
  std::string channelData;
};

// Why an op's transfer is to stop.
enum class Cancel : uint8_t {
  kFailed,         // the op failed here (timeout, peer failure, group closed)
  kPartnerGaveUp,  // the partner told us it will never move this op's bytes
};

// The per-op part of a channel: made by Channel::prepare on the caller's thread, held by the
// op (and, for a CUDA op, by its caller's fence); what the channel keeps for the op lives here.
// Every method but the fence's runs on the progress thread.
class ChannelOp : public CudaFence {
 public:
  explicit ChannelOp(OpTraits traits) : traits_(traits) {}
  const OpTraits& traits() const { return traits_; }

  // Sender, as the send starts: what its announcement carries; starts what needs no receiver.
  virtual ChannelAnnouncement announce(const std::shared_ptr<Op>& send, Peer& destination) = 0;
  // Receiver, matched: gets ready for the bytes, given what the sender's announcement said;
  // returns what the sender's side needs to deliver them (ClearToSend::channelData).
  virtual std::string arm(const std::shared_ptr<Op>& recv, Peer& source,
                          const std::string& announced) = 0;
  // The bytes may move: a send has its clear-to-send (`channelData`: what the receiver's arm()
  // returned); a recv's clear-to-send has left (`promised`: as its announcement said).
  virtual void start(const std::shared_ptr<Op>& op, Peer& partner,
                     const std::string& channelData, bool promised) = 0;
  // The op has failed (or its partner gave up): stop its transfer where possible. Done still
  // follows once the channel no longer touches the buffer.
  virtual void cancel(Op& op, Cancel why) = 0;
  // The caller has been told the op's outcome: releases the waits on the caller's side that no
  // copy will release now.
  virtual void end(Op& op, const Status& status) = 0;
  // The op has ended and no transfer touches its buffer: gives back what prepare() took.
  virtual void release(Op& op) = 0;
  // For the pending-op table: what the op still waits for; empty if nothing to say.
  virtual std::string describe(const Op& op) const = 0;
  // Whether the op, not yet ended, may still move bytes after its caller's wait() returned.
  virtual bool outlivesWait(const Op& op) const = 0;

 private:
  const OpTraits traits_;
};

// The optional groups of Channel's members. A channel declares those it implements; the engine
// calls no member of a group its channel did not declare.
enum class Capability : uint32_t {
  kEndpoints = 1u << 0,     // connect(), disconnect(): it keeps per-peer endpoints
  kNotices = 1u << 1,       // onNotice()
  kProgress = 1u << 2,      // progress(), busy(): it is driven from the progress loop
  kSweep = 1u << 3,         // sweep()
  kAdmission = 1u << 4,     // admit(): it may hold back ops starting on any channel
  kSameHostOnly = 1u << 5,  // reaches only peers on this host
};

class Capabilities {
 public:
  Capabilities(std::initializer_list<Capability> all) {
    for (const Capability c : all) bits_ |= static_cast<uint32_t>(c);
  }
  bool has(Capability c) const { return (bits_ & static_cast<uint32_t>(c)) != 0; }

 private:
  uint32_t bits_ = 0;
};

// What reaches a channel outside an op's own messages (Capability::kNotices): from its peers,
// or the engine's closing of a group.
struct PeerNotice {  // a ChannelNotice's data
  Peer& source;
  const std::string& data;
};
struct SendAnnounced {  // a send announced with channel data, before it is matched
  Peer& source;
  const ReadyToSend& rts;
};
struct SendUnarmed {  // such an announcement that no recv will arm (refused, empty, group closed)
  Peer& source;
  const ReadyToSend& rts;
  Op* recv;  // the recv it was refused to, if any
};
struct MemoryFreed {  // MemoryReleased: the owner freed CUDA memory it had exported here
  const std::string& owner;
  const std::vector<uint64_t>& ids;
};
struct GroupClosed {  // its ops that the channel still holds back fail so
  uint64_t groupId;
  StatusCode code;
  const std::string& reason;
};
using Notice = std::variant<PeerNotice, SendAnnounced, SendUnarmed, MemoryFreed, GroupClosed>;

// What a pass of Channel::progress() did.
struct Progress {
  bool active = false;
  // The device whose context the progress thread keeps current for this channel; -1: none.
  int contextDevice = -1;
};

// For the pending-op table and the engine's stats.
struct ChannelReport {
  std::map<std::string, int64_t> stats;
  std::vector<std::string> memory;  // the memory the channel holds for peers
};

// A data channel moves the bytes of a matched send/recv pair; the control plane has already
// checked that both sides agree. This is its per-peer and loop part; each op's part is its
// ChannelOp. The caller's thread calls prepare() alone, the progress thread the rest. The
// engine reaches a channel through these two interfaces alone, and never names its types.
// Per-peer state (flag segments, staging rings, data endpoints) is the channel's, keyed by
// peer; the Peer itself holds identity and liveness.
class Channel {
 public:
  using Done = std::function<void(const std::shared_ptr<Op>&, const Status&)>;
  // Reports a peer failure that the channel's transport noticed (`why`).
  using PeerError = std::function<void(const std::string& why)>;

  explicit Channel(Capabilities capabilities) : capabilities_(capabilities) {}
  virtual ~Channel() = default;
  bool declares(Capability c) const { return capabilities_.has(c); }
  // Whether this channel can move bytes to and from the peer at all.
  bool reaches(const Peer& peer) const;

  // Caller's thread: an op at its post. Takes what the op needs (flags, events, staging) and
  // enqueues on the caller's stream what the op signals there at the post. Throws Error,
  // having taken nothing.
  virtual std::shared_ptr<ChannelOp> prepare(Op& op, const PostOptions& options) = 0;

  // ---------------------------------------------------------- progress thread
  // The peer is gone: nothing it was going to do for this channel will happen.
  virtual void peerFailed(Peer& peer) = 0;
  // Engine shutdown, the progress thread gone: waits, up to `deadline`, until the peers have
  // taken what this channel sent them, and fails what it still holds.
  virtual void flush(Clock::time_point deadline) = 0;
  // Stops the channel's own threads, and what its work may still wait for (process exit).
  virtual void stop() = 0;
  virtual void report(ChannelReport& report) const = 0;

  // kEndpoints. A peer joined: opens what reaches it and returns how CUDA ops toward it are
  // prepared. Throws Error when it cannot be reached.
  virtual PeerRoute connect(Peer& peer, const PeerError& onError);
  // kEndpoints. The failed peer is dropped, outside any transport callback.
  virtual void disconnect(Peer& peer);
  // kNotices.
  virtual void onNotice(const Notice& notice);
  // kProgress. Channels that watch memory rather than wait for events.
  virtual Progress progress();
  // kProgress. Whether it watches memory now (the loop then naps, never sleeps).
  virtual bool busy() const;
  // kSweep. Every few tens of milliseconds: what need not run on every pass.
  virtual void sweep();
  // kAdmission. Asked for every op that starts, on any channel, before anything else: false
  // where the channel holds it back; it then starts it later, in posting order.
  virtual bool admit(const std::shared_ptr<Op>& op);

 private:
  const Capabilities capabilities_;
};

}  // namespace smfree::engine
