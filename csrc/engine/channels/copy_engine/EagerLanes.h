#pragma once

#include <cuda.h>

#include <atomic>
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
#include "engine/channels/copy_engine/RingMemory.h"
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
// memory, sent with the lane's first clear-to-send of such a size. Message n of the lane, if
// it fits, has slot n % kEagerSlots, use n / kEagerSlots, and goes one of two ways:
//  - eager: the sender's copy engine copies it into the slot and raises the slot's word to
//    full(use); the receiver copies it out and raises the word to emptied(use);
//  - rendezvous: as a send without a lane (the slot is skipped).
// The slot's way word holds the decision, made once by whichever side comes first with one
// compare-and-swap (decideWay): the receiver's wait() claiming eager (it then queues the copy
// out on its stream, without waiting for the sender's CPU), or the sender's post, eager if
// the slot's last use is emptied, else rendezvous. A sender that finds its message claimed
// eager and the slot still full copies it later: the progress thread queues the copy once the
// receiver's GPU has emptied the slot (fill()). No post ever waits for the partner.
//
// Deadlock: every GPU operation is queued in program order (a send's copy at its post, or by
// the progress thread once the slot is empty, never behind a stream wait for the receiver; a
// recv's copy out at its wait()). The one stream wait on a partner is a recv's for its slot's
// full(use), and the copy it waits for is queued at the sender's post or, held, once the
// receiver's GPU has run the copy out of the slot's use before, which the receiver queued
// earlier in the lane's order. A cycle of waits is a cycle in the programs (the same one hangs
// on NCCL). A rendezvous waits on the CPUs, in wait(), for the partner's post, which no post
// of the partner's waits for.
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

// Which way a message of a lane goes (a slot's way word says it per use). kAsAnnounced: the
// sender decided it and went on to the slot's later uses; its announcement says which.
enum class Way : int { kUndecided = -1, kEager = 0, kRendezvous = 1, kAsAnnounced = 2 };

// The way of use `use` of a slot whose way word is `word` (`way` its flag; its values only
// grow: use u decided eager is way.value + 2u, rendezvous way.value + 2u + 1): `mine` unless
// the other side decided first (one compare-and-swap). Each side decides a slot's uses in
// order, but one may run ahead: nothing where the word has passed the use, which the other
// side then decided. (The receiver only decides eager, so a sender finding its use passed
// goes eager; a receiver learns the sender's way from its announcement.)
std::optional<Way> decideWay(volatile uint32_t* word, const cuda::Flag& way, uint32_t use,
                             Way mine);

// An eager send, as its post left it.
struct EagerSend {
  EagerSlot slot;
  // The slot's previous use, still full at the post: the copy waits for the progress thread
  // (EagerLanes::fill), once the receiver has emptied it.
  std::optional<uint32_t> after;
};

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
  // The message's way, once this side has read or decided it (Way).
  std::atomic<Way> way{Way::kUndecided};

  std::mutex mutex;  // the fields below
  std::shared_ptr<StagingRing> ring;    // once claimed by the caller
  std::shared_ptr<cuda::Event> copied;  // recorded after the caller's copy out
  bool queued = false;     // the caller's copy out is on its stream
  bool abandoned = false;  // the op failed first: the progress thread empties the slot

  bool claimBy(Claim who);  // true if `who` has it now
  bool mayBeEager() const;  // its way is eager or not yet known
};

class EagerLanes {
 public:
  // `slotBytes` (SMFREE_EAGER_BYTES): the size of a slot of the rings this process gives its
  // senders, within `memory`; 0 turns eager sends off both ways.
  EagerLanes(cuda::FlagSegment& flags, RingMemory& memory, uint64_t slotBytes);
  bool enabled() const { return slotBytes_ != 0; }
  uint64_t slotBytes() const { return slotBytes_; }

  // ---------------------------------------------------------------- sender
  // Caller's thread, at a CUDA send's post, in its lane's order: on an open lane, decides the
  // message's way; eager with its slot empty, copies the buffer into the slot after
  // `produced` and records `copied`. Returns the send, or nothing where it goes by rendezvous
  // (lane not open, a size that does not fit and takes no slot, or the slot still full and
  // not claimed by the receiver). Never waits; throws Error (naming `op`).
  std::optional<EagerSend> push(const Op& op, const LaneKey& lane, cuda::Event& produced,
                                cuda::Event& copied);
  // Progress thread: queues a held eager send's copy (as push() does) once its receiver has
  // emptied the slot's previous use; false until then. Throws Error where the lane is gone.
  bool fill(const Op& op, const LaneKey& lane, const EagerSend& send, cuda::Event& produced,
            cuda::Event& copied);
  // Progress thread: the receiver's ring for the lane, sent with a clear-to-send.
  void open(const LaneKey& lane, std::shared_ptr<RemoteStagingRing> ring,
            cuda::RemoteFlagSegment& words);

  // ---------------------------------------------------------------- receiver
  // Progress thread: the ring to send with a clear-to-send of the lane, made on `device` on
  // first use, within the rings' memory bound; null where none can be had.
  std::shared_ptr<StagingRing> ringFor(const LaneKey& lane, int device);
  // The lane's ring; null where it has none.
  std::shared_ptr<StagingRing> ring(const LaneKey& lane);
  // Progress thread: an eager message `seq` of the lane was announced.
  void announced(const LaneKey& lane, uint64_t seq);
  // Caller's thread, at a recv's post whose place in its lane is known.
  void posted(const std::shared_ptr<EagerRecv>& recv);
  // Caller's thread, at a recv's wait(): whether the recv's message is eager and its wait()
  // may queue its copy out (or has). Where the lane shows the message can be eager, decides
  // the ways of the lane's posted recvs up to it, claiming eager where the sender has not
  // decided.
  bool claimable(EagerRecv& recv);
  // Caller's thread, at a recv's wait(): claims the copy out for the caller where claimable,
  // and queues it on `stream`, after those of the lane's earlier recvs not queued yet: copies
  // out run in the lane's order, whatever the order of the wait() calls, so a slot is never
  // awaited behind a copy out that empties the slot before it. False unless claimable() found
  // it eager.
  bool queueCopiesOut(EagerRecv& recv, CUstream stream);

  // The peer process is gone: forgets its lanes (raising the words of rings it wrote).
  void dropPeer(const std::string& processKey);
  int64_t lanes() const;  // with a ring, either way
  // Copies out queued by recvs' wait() calls.
  int64_t queuedByWait() const { return static_cast<int64_t>(queuedByWait_.load()); }
  // Sends whose slot was still full at their post: held for fill(), or gone by rendezvous.
  int64_t heldSends() const { return static_cast<int64_t>(heldSends_.load()); }
  int64_t rendezvousSends() const { return static_cast<int64_t>(rendezvousSends_.load()); }

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

  // The recv's ring where its message can be eager; null where that is not known.
  std::shared_ptr<StagingRing> predictLocked(const EagerRecv& recv) const;  // under mutex_
  // The recv's way, deciding it (eager) where no side has; `ring` from predictLocked().
  Way decideLocked(EagerRecv& recv, const StagingRing& ring);
  // Decides, in the lane's order, the ways of its posted recvs before `recv` that can be
  // eager: a slot's uses are decided in order. Under mutex_.
  void decideEarlierLocked(const EagerRecv& recv);
  // Queues one claimed copy out, under its mutex; true the first time.
  bool queueCopyOutLocked(EagerRecv& recv, CUstream stream);
  // Queues the copy of `buffer` into the slot and the raise of its word to full.
  void enqueueFill(Outgoing& lane, const EagerSlot& eager, const Buffer& buffer,
                   cuda::Event& produced, cuda::Event& copied);
  CUstream stream(int localDevice, int ringDevice);  // under mutex_

  cuda::FlagSegment& flags_;
  RingMemory& memory_;
  uint64_t slotBytes_;
  mutable std::mutex mutex_;
  std::map<LaneKey, std::shared_ptr<Outgoing>> outgoing_;
  std::map<LaneKey, Incoming> incoming_;
  // Recvs posted with a known place, by lane and number, until some side claims their copy out.
  std::map<LaneKey, std::map<uint64_t, std::weak_ptr<EagerRecv>>> posted_;
  std::map<std::pair<int, int>, std::unique_ptr<cuda::Stream>> streams_;
  std::atomic<uint64_t> queuedByWait_{0};
  std::atomic<uint64_t> heldSends_{0};
  std::atomic<uint64_t> rendezvousSends_{0};
};

}  // namespace smfree::engine
