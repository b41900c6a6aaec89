#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/CudaFence.h"
#include "engine/Op.h"
#include "engine/Status.h"

namespace smfree::engine {

struct Peer;
struct PeerAddress;

// How the caller's thread prepares CUDA ops with one peer: decided by the channel on the
// progress thread when the peer connects (route()), kept by the group per rank.
struct PeerRoute {
  bool stagedThroughHost = false;  // UCX: CUDA buffers cross pinned host memory
};

// What the caller's thread knows when it posts a CUDA op.
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

// A data channel moves the bytes of a matched send/recv pair; the control plane has already
// checked that both sides agree. A channel owns both halves of its work:
//  - the caller's thread (Group): prepare() enqueues on the caller's stream, at the post,
//    what the op signals there, and the fence methods let the caller's stream wait for the
//    op's copies;
//  - the progress thread (the engine's): everything else. The engine reaches a channel
//    through this interface alone.
// Per-peer state (flag segments, staging rings, data endpoints) is the channel's, keyed by
// peer; the Peer itself holds identity and liveness.
class Channel {
 public:
  using Done = std::function<void(const std::shared_ptr<Op>&, const Status&)>;
  // Reports a peer failure that the channel's transport noticed (`why`).
  using PeerError = std::function<void(const std::string& why)>;

  virtual ~Channel() = default;

  // ---------------------------------------------------------- caller's thread
  // A CUDA op at its post: takes what the op needs (flags, events, staging) into
  // op.channelState and enqueues on the caller's stream what the op signals there at the post.
  // Returns what the caller's stream waits on. Throws Error, having taken nothing.
  virtual CudaFence prepare(Op& op, const PostOptions& options) = 0;
  // Never blocks: true once the op's copies are submitted to the GPU, or the op failed, so the
  // caller's stream may wait on the fence. Where the channel leaves the copies to the caller's
  // thread (UCX's staged recvs), queues them once the match allows.
  virtual bool fenceQueued(const CudaFence& fence) = 0;
  // Makes `stream` wait for the op's copies; only once fenceQueued() said so.
  virtual void waitOnStream(void* stream, int device, const CudaFence& fence) = 0;

  // ---------------------------------------------------------- progress thread
  // A peer joined: opens what reaches it. Throws Error when it cannot be reached.
  virtual void connect(Peer& peer, const PeerError& onError) {}
  virtual PeerRoute route(Peer& peer) { return {}; }
  // Whether this channel can move bytes to and from the peer at all.
  virtual bool reaches(const Peer& peer) const { return true; }
  // The failed peer is dropped, outside any transport callback: closes what reached it.
  virtual void disconnect(Peer& peer) {}
  // The peer is gone: nothing it was going to do for this channel will happen.
  virtual void peerFailed(Peer& peer) {}
  // Engine shutdown, the progress thread gone: waits, up to `deadline`, until the peers have
  // taken what this channel sent them.
  virtual void flush(Clock::time_point deadline) {}

  // Whether the progress thread makes CUDA calls for the op.
  virtual bool callsCudaOnProgressThread(const Op& op) const = 0;
  // The progress thread makes CUDA calls from now on, the first time for `op`.
  virtual void progressThreadCallsCuda(const Op& op) {}
  // A peer's stream may wait for bytes that this channel has still to move, relying on the
  // progress thread making no CUDA call: an op that makes one waits until this is false.
  virtual bool committed() const { return false; }
  // Sender, when the send starts, before its announcement: whether it is promised
  // (ReadyToSend::promised).
  virtual bool promiseSend(Op& send) { return false; }

  // Sender, as the send is announced: what the receiver's channel is to learn with it
  // (ReadyToSend::channelData), such as where the bytes already are.
  virtual std::string announce(const Op& send) { return {}; }
  // Sender, when the send is posted (before its receiver has matched it): start what needs
  // no receiver.
  virtual void prepareSend(const std::shared_ptr<Op>& send, Peer& destination) {}
  // Receiver: get ready for the bytes, given what the sender's announce() said; returns what
  // the sender's side needs to deliver them.
  virtual std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                              const std::string& announced) = 0;
  // Receiver: an announcement with channel data arrived (before it is matched).
  virtual void announced(Peer& source, const ReadyToSend& rts) {}
  // Receiver: an announcement with channel data that no recv will arm (refused, empty, or its
  // group closed): gives back what the data holds. `recv`: the recv it was refused to, if any.
  virtual void discard(Peer& source, const ReadyToSend& rts, Op* recv) {}
  // Receiver, once the clear-to-send has left; `sendPromised` as the announcement said.
  virtual void cleared(const std::shared_ptr<Op>& recv, bool sendPromised) {}
  // Sender: deliver the bytes, given what armRecv returned on the receiver.
  virtual void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                         const std::string& channelData) = 0;
  // An op with no partner process (to the rank itself) has started: the channel, which paired
  // it at its post, ends it through Done.
  virtual void start(const std::shared_ptr<Op>& op) {}
  // The op has failed: stop its transfer where possible. Done still follows once the channel
  // no longer touches the buffer.
  virtual void cancel(Op& op) = 0;
  // The partner told us it will never move this op's bytes.
  virtual void partnerGaveUp(Op& op) { cancel(op); }
  // The caller has been told the op's outcome: releases the waits on the caller's side that
  // no copy will release now.
  virtual void ended(Op& op, const Status& status) {}
  // The op has ended and no transfer touches its buffer: gives back what prepare() took.
  virtual void release(Op& op) {}
  // Whether the op, not yet ended, may still move bytes after its caller's wait() returned.
  virtual bool outlivesWait(const Op& op) const { return false; }

  // A sender's channel notice (ChannelNotice) for this channel.
  virtual void onNotice(Peer& source, const std::string& data) {}
  // The owner freed CUDA memory it had exported to this process (MemoryReleased).
  virtual void onMemoryReleased(const std::string& owner, const std::vector<uint64_t>& ids) {}

  // Channels that watch memory rather than wait for events are driven from the progress loop.
  virtual bool progress() { return false; }
  virtual bool busy() const { return false; }
  // Every few tens of milliseconds: what need not run on every pass.
  virtual void sweep() {}
  // The device whose context the progress thread keeps current for this channel; -1: none.
  virtual int contextDevice() const { return -1; }
  // Stops the channel's own threads (process exit).
  virtual void stop() {}

  // For the pending-op table: what the op still waits for; empty if nothing to say.
  virtual std::string describeWait(const Op& op) const { return {}; }
  // For the pending-op table's end: the memory the channel holds for peers; empty if none.
  virtual std::string describeMemory() const { return {}; }
  virtual void addStats(std::map<std::string, int64_t>& stats) const {}
};

}  // namespace smfree::engine
