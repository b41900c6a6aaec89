#include "engine/channels/copy_engine/EagerLanes.h"

#include <algorithm>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/Spin.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

EagerSlot eagerSlotOf(uint64_t seq, int device) {
  return EagerSlot{StagedSlot{static_cast<uint32_t>(seq % kEagerSlots),
                              static_cast<uint32_t>(seq / kEagerSlots)},
                   device};
}

std::optional<Way> decideWay(volatile uint32_t* word, const cuda::Flag& way, uint32_t use,
                             Way mine) {
  uint32_t* plain = const_cast<uint32_t*>(word);
  const uint32_t eager = way.value + 2 * use;
  uint32_t seen = __atomic_load_n(plain, __ATOMIC_ACQUIRE);
  // Each turn follows a change of the word by the other side, which makes one at most.
  SpinDeadline deadline(std::chrono::seconds(1), "an eager lane's decision of a way");
  for (; !cuda::reached(seen, eager); deadline.check()) {
    const uint32_t decided = eager + static_cast<uint32_t>(mine);
    if (__atomic_compare_exchange_n(plain, &seen, decided, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
      return mine;
    }
  }
  if (seen - eager > 1) return std::nullopt;
  return seen == eager ? Way::kEager : Way::kRendezvous;
}

bool EagerRecv::mayBeEager() const {
  const Way known = way.load();
  return known == Way::kUndecided || known == Way::kEager;
}

bool EagerRecv::claimBy(Claim who) {
  int open = kOpen;
  return claim.compare_exchange_strong(open, who) || open == who;
}

EagerLanes::EagerLanes(cuda::FlagSegment& flags, RingMemory& memory, uint64_t slotBytes)
    : flags_(flags), memory_(memory), slotBytes_(slotBytes) {}

std::optional<EagerSend> EagerLanes::push(const Op& op, const LaneKey& lane,
                                          cuda::Event& produced, cuda::Event& copied) {
  std::shared_ptr<Outgoing> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto known = outgoing_.find(lane);
    if (known == outgoing_.end()) return std::nullopt;  // its first clear-to-send is to come
    out = known->second;
  }
  const Buffer& buffer = op.request.buffer;
  if (buffer.bytes == 0 || buffer.bytes > out->ring->slotBytes()) return std::nullopt;
  const EagerSlot eager = eagerSlotOf(op.seq, out->ring->device());
  const std::optional<uint32_t> last = out->last[eager.staged.slot];
  const bool empty =
      !last || out->words->isSet(slotEmptied(out->ring->wordOf(eager.staged.slot), *last));
  const cuda::Flag& wayWord = out->ring->wayOf(eager.staged.slot);
  const Way way = decideWay(out->words->word(wayWord), wayWord, eager.staged.use,
                            empty ? Way::kEager : Way::kRendezvous)
                      .value_or(Way::kEager);
  if (way == Way::kRendezvous) {
    rendezvousSends_.fetch_add(1, std::memory_order_relaxed);
    return std::nullopt;
  }
  out->last[eager.staged.slot] = eager.staged.use;
  if (!empty) {
    // The receiver claimed it eager; its copy out of `last` comes first in the lane: fill().
    heldSends_.fetch_add(1, std::memory_order_relaxed);
    return EagerSend{eager, last};
  }
  enqueueFill(*out, eager, buffer, produced, copied);
  return EagerSend{eager, std::nullopt};
}

bool EagerLanes::fill(const Op& op, const LaneKey& lane, const EagerSend& send,
                      cuda::Event& produced, cuda::Event& copied) {
  std::shared_ptr<Outgoing> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto known = outgoing_.find(lane);
    if (known == outgoing_.end()) {
      fail(op.describe(), " failed: its receiver's eager ring is gone");
    }
    out = known->second;
  }
  const uint32_t slot = send.slot.staged.slot;
  if (send.after && !out->words->isSet(slotEmptied(out->ring->wordOf(slot), *send.after))) {
    return false;
  }
  enqueueFill(*out, send.slot, op.request.buffer, produced, copied);
  return true;
}

void EagerLanes::enqueueFill(Outgoing& lane, const EagerSlot& eager, const Buffer& buffer,
                             cuda::Event& produced, cuda::Event& copied) {
  cuda::ContextGuard context(buffer.device);
  CUstream copyStream = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    copyStream = stream(buffer.device, eager.device);
  }
  // `produced` is recorded; the slot is empty. No wait for anything of the receiver's.
  produced.waitOn(copyStream);
  cuda::queueCopy(copyStream, buffer.device,
                  {lane.ring->slotAddress(eager.staged, buffer.device), eager.device},
                  cuda::Place::of(buffer.data, buffer.device), buffer.bytes,
                  "cuMemcpyAsync (to an eager slot)");
  copied.record(copyStream);
  const cuda::Flag full = lane.ring->full(eager.staged);
  cuda::writeWord(copyStream, lane.words->cudaAddress(full.index), full.value,
                  "cuStreamWriteValue32 (eager slot full)");
}

CUstream EagerLanes::stream(int localDevice, int ringDevice) {
  auto& stream = streams_[{localDevice, ringDevice}];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(localDevice, cuda::Stream::OnDestroy::kRelease);
    log(LogLevel::kInfo, "eager stream for cuda:", localDevice, " -> peer cuda:", ringDevice);
  }
  return stream->handle();
}

void EagerLanes::open(const LaneKey& lane, std::shared_ptr<RemoteStagingRing> ring,
                      cuda::RemoteFlagSegment& words) {
  if (!enabled() || ring->slots() != kEagerSlots || !ring->hasWays()) return;
  // Registered here, once: callers' threads then only read the segment's CUDA address.
  words.cudaAddress(0);
  std::lock_guard<std::mutex> lock(mutex_);
  auto& out = outgoing_[lane];
  if (out) return;  // the first stays: a queued copy may still write into it
  out = std::make_shared<Outgoing>();
  out->ring = std::move(ring);
  out->words = &words;
  out->last.assign(kEagerSlots, std::nullopt);
}

std::shared_ptr<StagingRing> EagerLanes::ringFor(const LaneKey& lane, int device) {
  if (!enabled()) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  if (const auto known = incoming_.find(lane); known != incoming_.end()) return known->second.ring;
  Incoming& in = incoming_[lane];
  try {
    in.ring = std::make_shared<StagingRing>(
        flags_, memory_, device, slotBytes_, kEagerSlots, true,
        concat("eager ring of ", kEagerSlots, " x ", slotBytes_, " B for group ", lane.group,
               " tag ", lane.tag, " from ", lane.peer));
  } catch (const Error& error) {
    RingMemory::refused(concat("no eager ring on cuda:", device, " for group ", lane.group,
                               " tag ", lane.tag, " from ", lane.peer, " (", reasonOf(error),
                               "): its sends go by rendezvous"));
  }
  return in.ring;
}

std::shared_ptr<StagingRing> EagerLanes::ring(const LaneKey& lane) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto known = incoming_.find(lane);
  return known == incoming_.end() ? nullptr : known->second.ring;
}

void EagerLanes::announced(const LaneKey& lane, uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto known = incoming_.find(lane);
  if (known != incoming_.end()) known->second.firstEager = std::min(known->second.firstEager, seq);
}

void EagerLanes::posted(const std::shared_ptr<EagerRecv>& recv) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& line = posted_[recv->lane];
  // Forgets, from the front, the recvs whose copy out is claimed or which are gone.
  while (!line.empty()) {
    const auto front = line.begin()->second.lock();
    if (front && front->claim.load() == EagerRecv::kOpen && front->mayBeEager()) {
      break;
    }
    line.erase(line.begin());
  }
  line.emplace(recv->seq, recv);
}

std::shared_ptr<StagingRing> EagerLanes::predictLocked(const EagerRecv& recv) const {
  const auto known = incoming_.find(recv.lane);
  if (known == incoming_.end() || !known->second.ring) return nullptr;
  // From the first eager message on, every message that fits can be eager, as the recv does.
  if (recv.seq < known->second.firstEager || recv.buffer.bytes == 0 ||
      recv.buffer.bytes > known->second.ring->slotBytes()) {
    return nullptr;
  }
  return known->second.ring;
}

Way EagerLanes::decideLocked(EagerRecv& recv, const StagingRing& ring) {
  const Way known = recv.way.load();
  if (known != Way::kUndecided) return known;
  const EagerSlot eager = eagerSlotOf(recv.seq, ring.device());
  const cuda::Flag& wayWord = ring.wayOf(eager.staged.slot);
  const Way way = decideWay(flags_.word(wayWord), wayWord, eager.staged.use, Way::kEager)
                      .value_or(Way::kAsAnnounced);
  recv.way.store(way);
  return way;
}

void EagerLanes::decideEarlierLocked(const EagerRecv& recv) {
  for (auto& [seq, weak] : posted_[recv.lane]) {
    if (seq >= recv.seq) break;
    const auto other = weak.lock();
    if (!other || other->claim.load() != EagerRecv::kOpen) continue;
    if (const auto ring = predictLocked(*other)) decideLocked(*other, *ring);
  }
}

bool EagerLanes::claimable(EagerRecv& recv) {
  const int claim = recv.claim.load();
  if (claim == EagerRecv::kByCaller) return true;
  if (claim != EagerRecv::kOpen || !recv.mayBeEager()) {
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const auto ring = predictLocked(recv);
  if (!ring) return false;
  decideEarlierLocked(recv);
  return decideLocked(recv, *ring) == Way::kEager;
}

bool EagerLanes::queueCopiesOut(EagerRecv& recv, CUstream stream) {
  std::vector<std::pair<std::shared_ptr<EagerRecv>, std::shared_ptr<StagingRing>>> earlier;
  std::shared_ptr<StagingRing> ring;
  if (recv.claim.load() != EagerRecv::kByCaller) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Reached once claimable() said so, which decided the lane's ways up to this recv.
    if (recv.way.load() != Way::kEager) return false;
    ring = predictLocked(recv);
    if (!ring) return false;
    auto& line = posted_[recv.lane];
    for (auto it = line.begin(); it != line.end() && it->first < recv.seq;) {
      auto other = it->second.lock();
      if (other && other->claim.load() == EagerRecv::kOpen &&
          other->way.load() == Way::kEager) {
        if (auto otherRing = predictLocked(*other)) earlier.emplace_back(other, otherRing);
      }
      it = line.erase(it);
    }
  }
  for (auto& [other, otherRing] : earlier) {
    std::lock_guard<std::mutex> lock(other->mutex);
    if (!other->claimBy(EagerRecv::kByCaller)) continue;  // the progress thread has it
    other->ring = otherRing;
    queueCopyOutLocked(*other, stream);
  }
  std::lock_guard<std::mutex> lock(recv.mutex);
  if (ring) {
    if (!recv.claimBy(EagerRecv::kByCaller)) return false;
    recv.ring = std::move(ring);
  }
  queueCopyOutLocked(recv, stream);
  return true;
}

bool EagerLanes::queueCopyOutLocked(EagerRecv& recv, CUstream stream) {
  if (recv.queued) {
    recv.copied->waitOn(stream);
    return false;
  }
  if (recv.abandoned) return false;  // the op failed; the progress thread empties the slot
  const int device = recv.buffer.device;
  const EagerSlot eager = eagerSlotOf(recv.seq, recv.ring->device());
  cuda::ContextGuard context(device);
  // Queued by the sender at its post: a wait for the future of the sender's CPU only, never
  // for work of this process (see the deadlock argument above).
  const cuda::Flag full = recv.ring->full(eager.staged);
  cuda::waitForRemoteWrites(stream, device, flags_.cudaAddress(full.index), full.value,
                            "cuStreamWaitValue32 (eager slot full)");
  cuda::queueCopy(stream, device, cuda::Place::of(recv.buffer.data, device),
                  {recv.ring->slotAddress(eager.staged.slot), recv.ring->device()},
                  recv.buffer.bytes, "cuMemcpyAsync (out of an eager slot)");
  recv.copied = cuda::takeEvent(device);
  recv.copied->record(stream);
  const cuda::Flag emptied = recv.ring->emptied(eager.staged);
  cuda::writeWord(stream, flags_.cudaAddress(emptied.index), emptied.value,
                  "cuStreamWriteValue32 (eager slot emptied)");
  recv.queued = true;
  queuedByWait_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void EagerLanes::dropPeer(const std::string& processKey) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    if (it->first.peer != processKey) {
      ++it;
      continue;
    }
    if (it->second.ring) it->second.ring->releaseWaits();
    it = incoming_.erase(it);  // recvs still copying out hold the ring
  }
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    it = it->first.peer == processKey ? outgoing_.erase(it) : std::next(it);
  }
}

int64_t EagerLanes::lanes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto withRing = std::count_if(incoming_.begin(), incoming_.end(),
                                      [](const auto& in) { return in.second.ring != nullptr; });
  return static_cast<int64_t>(withRing + outgoing_.size());
}

}  // namespace smfree::engine
