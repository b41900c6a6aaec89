#pragma once

#include <cuda.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/Op.h"
#include "engine/channels/copy_engine/StagingRing.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/Stream.h"

namespace smfree::engine {

// Eager lanes: how a small CUDA send reaches its receiver with neither CPU waiting for the
// other's (see CopyEngineChannel.h for where they sit in the protocol).
//
// A lane is one (sending process, receiving process, group, tag) line of messages, numbered
// by Op::seq on both sides at the post (Group): the n-th send meets the n-th recv. The
// receiver gives each lane a ring of kEagerSlots slots of SMFREE_EAGER_BYTES in its GPU
// memory, sent with the lane's first clear-to-send of such a size. From the first send the
// sender posts after that on, every CUDA send of the lane with 1 to slot-size bytes is eager:
// message n goes to slot n % kEagerSlots, use n / kEagerSlots, copied at its post by the
// sender's copy engine, which then raises the slot's word to full(use). No message falls back
// to a rendezvous, so the receiver, once an announcement has shown it the lane is eager, knows
// at its wait() where message n will be and queues on its own stream the wait for full(use),
// the copy out and the raise to emptied(use), without waiting for the sender's CPU.
//
// The one wait on the partner's CPU left is the sender's, for a slot still full: at most
// kEagerSlots messages of a lane are in the receiver's memory, and the send's post waits on the
// CPU (up to the group timeout) until the receiver's GPU has emptied the slot's last use.
//
// Deadlock: every GPU operation of an eager op is queued in program order, the send's at its
// post and the recv's at its wait(); the only stream wait on a partner is the recv's, for a
// copy its sender queues at a post that the receiver's own program does not need to come
// first. A cycle of such waits is a cycle in the program (the same one hangs on NCCL); a
// sender waiting for a slot is bounded by the group timeout.
struct LaneKey {
  std::string peer;  // the other side's process key
  uint64_t group = 0;
  int32_t tag = 0;

  bool operator<(const LaneKey& other) const {
    return std::tie(peer, group, tag) < std::tie(other.peer, other.group, other.tag);
  }
};

// Where an eager message is: a slot and its use, in a ring on the receiver's `device`.
struct EagerSlot {
  StagedSlot staged;
  int32_t device = -1;
};

EagerSlot eagerSlotOf(uint64_t seq, int device);

// A CUDA recv whose copy out of its eager slot its caller's wait() may queue. Shared by the op
// (progress thread) and its fence (callers' threads).
struct EagerRecv {
  enum Claim : int { kOpen, kByCaller, kByProgress };

  LaneKey lane;
  uint64_t seq = 0;
  Buffer buffer;
  // Who queues the copy out: the caller's wait() (which predicts the slot) or the progress
  // thread (at the match). Taken once.
  std::atomic<int> claim{kOpen};

  std::mutex mutex;  // the fields below
  std::shared_ptr<StagingRing> ring;    // once claimed by the caller
  std::shared_ptr<cuda::Event> copied;  // recorded after the caller's copy out
  bool queued = false;     // the caller's copy out is on its stream
  bool abandoned = false;  // the op failed first: the progress thread empties the slot

  bool claimBy(Claim who);  // true if `who` has it now
};

class EagerLanes {
 public:
  // `slotBytes` (SMFREE_EAGER_BYTES): the size of a slot of the rings this process gives its
  // senders; 0 turns eager sends off both ways.
  EagerLanes(cuda::FlagSegment& flags, uint64_t slotBytes);
  bool enabled() const { return slotBytes_ != 0; }
  uint64_t slotBytes() const { return slotBytes_; }

  // ---------------------------------------------------------------- sender
  // Caller's thread, at a CUDA send's post, in its lane's order: on an open lane, copies the
  // buffer into message `seq`'s slot after `produced` and records `copied`. Returns the slot,
  // or nothing where the send goes by rendezvous (lane not open, or the size does not fit,
  // which then takes no slot). Waits up to `timeout` for the slot; throws Error (naming `op`).
  std::optional<EagerSlot> push(const Op& op, const LaneKey& lane, cuda::Event& produced,
                                cuda::Event& copied, std::chrono::milliseconds timeout);
  // Progress thread: the receiver's ring for the lane, sent with a clear-to-send.
  void open(const LaneKey& lane, std::shared_ptr<RemoteStagingRing> ring,
            cuda::RemoteFlagSegment& words);

  // ---------------------------------------------------------------- receiver
  // Progress thread: the ring to send with a clear-to-send of the lane, made on `device` on
  // first use (at most kLanesPerPeer per sending process); null where none can be had.
  std::shared_ptr<StagingRing> ringFor(const LaneKey& lane, int device);
  // The lane's ring; null where it has none.
  std::shared_ptr<StagingRing> ring(const LaneKey& lane);
  // Progress thread: an eager message `seq` of the lane was announced.
  void announced(const LaneKey& lane, uint64_t seq);
  // Caller's thread, at a recv's post whose place in its lane is known.
  void posted(const std::shared_ptr<EagerRecv>& recv);
  // Caller's thread, at a recv's wait(): whether the lane shows the recv's message will be
  // eager, so that the wait() may queue its copy out (or has).
  bool claimable(const EagerRecv& recv) const;
  // Caller's thread, at a recv's wait(): claims the copy out for the caller where claimable,
  // and queues it on `stream`, after those of the lane's earlier recvs not queued yet: copies
  // out run in the lane's order, whatever the order of the wait() calls, so a slot is never
  // awaited behind a copy out that empties the slot before it. False where not claimable.
  bool queueCopiesOut(EagerRecv& recv, CUstream stream);

  // The peer process is gone: forgets its lanes (raising the words of rings it wrote).
  void dropPeer(const std::string& processKey);
  int64_t lanes() const;
  // Copies out queued by recvs' wait() calls.
  int64_t queuedByWait() const { return static_cast<int64_t>(queuedByWait_.load()); }

  // A lane per sending process and tag is the pipeline's case; more cost memory, not speed.
  static constexpr size_t kLanesPerPeer = 4;

 private:
  struct Outgoing {
    std::shared_ptr<RemoteStagingRing> ring;
    cuda::RemoteFlagSegment* words = nullptr;
    std::vector<std::optional<uint32_t>> last;  // per slot, the last use this side filled
  };
  struct Incoming {
    std::shared_ptr<StagingRing> ring;
    uint64_t firstEager = UINT64_MAX;  // the lowest eager message announced
  };

  // The recv's ring where its message will be eager; null where that is not known.
  std::shared_ptr<StagingRing> predict(const EagerRecv& recv) const;
  std::shared_ptr<StagingRing> predictLocked(const EagerRecv& recv) const;  // under mutex_
  // Queues one claimed copy out, under its mutex; true the first time.
  bool queueCopyOutLocked(EagerRecv& recv, CUstream stream);
  // Waits until the slot's last use is emptied; throws Error after `timeout`.
  static void awaitSlot(const Op& op, const Outgoing& lane, const StagedSlot& slot,
                        std::chrono::milliseconds timeout);
  CUstream stream(int localDevice, int ringDevice);  // under mutex_

  cuda::FlagSegment& flags_;
  uint64_t slotBytes_;
  mutable std::mutex mutex_;
  std::map<LaneKey, std::shared_ptr<Outgoing>> outgoing_;
  std::map<LaneKey, Incoming> incoming_;
  // Recvs posted with a known place, by lane and number, until some side claims their copy out.
  std::map<LaneKey, std::map<uint64_t, std::weak_ptr<EagerRecv>>> posted_;
  std::map<std::pair<int, int>, std::unique_ptr<cuda::Stream>> streams_;
  std::atomic<uint64_t> queuedByWait_{0};
};

}  // namespace smfree::engine
