#include "engine/channels/copy_engine/EagerLanes.h"

#include <algorithm>
#include <thread>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {

EagerSlot eagerSlotOf(uint64_t seq, int device) {
  return EagerSlot{StagedSlot{static_cast<uint32_t>(seq % kEagerSlots),
                              static_cast<uint32_t>(seq / kEagerSlots)},
                   device};
}

bool EagerRecv::claimBy(Claim who) {
  int open = kOpen;
  return claim.compare_exchange_strong(open, who) || open == who;
}

EagerLanes::EagerLanes(cuda::FlagSegment& flags, uint64_t slotBytes)
    : flags_(flags), slotBytes_(slotBytes) {}

std::optional<EagerSlot> EagerLanes::push(const Op& op, const LaneKey& lane,
                                          cuda::Event& produced, cuda::Event& copied,
                                          std::chrono::milliseconds timeout) {
  std::shared_ptr<Outgoing> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto known = outgoing_.find(lane);
    if (known == outgoing_.end()) return std::nullopt;  // its first clear-to-send is to come
    // From here on every message of the lane that fits is eager: its receiver relies on it.
    out = known->second;
  }
  const Buffer& buffer = op.request.buffer;
  if (buffer.bytes == 0 || buffer.bytes > out->ring->slotBytes()) return std::nullopt;
  const EagerSlot eager = eagerSlotOf(op.seq, out->ring->device());
  awaitSlot(op, *out, eager.staged, timeout);
  cuda::ContextGuard context(buffer.device);
  CUstream copyStream = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    copyStream = stream(buffer.device, eager.device);
  }
  // `produced` was just recorded; the slot is empty. No wait for anything of the receiver's.
  produced.waitOn(copyStream);
  cuda::check(cuda::driver().cuMemcpyAsync(out->ring->slotAddress(eager.staged, buffer.device),
                                           reinterpret_cast<CUdeviceptr>(buffer.data),
                                           buffer.bytes, copyStream),
              "cuMemcpyAsync (to an eager slot)");
  copied.record(copyStream);
  const cuda::Flag full = out->ring->full(eager.staged);
  cuda::writeWord(copyStream, out->words->cudaAddress(full.index), full.value,
                  "cuStreamWriteValue32 (eager slot full)");
  out->last[eager.staged.slot] = eager.staged.use;
  return eager;
}

void EagerLanes::awaitSlot(const Op& op, const Outgoing& lane, const StagedSlot& slot,
                           std::chrono::milliseconds timeout) {
  const std::optional<uint32_t> last = lane.last[slot.slot];
  if (!last) return;
  const cuda::Flag emptied = slotEmptied(lane.ring->wordOf(slot.slot), *last);
  if (lane.words->isSet(emptied)) return;
  // The receiver's GPU empties it once the recv of message seq - kEagerSlots is waited for.
  const auto deadline = Clock::now() + timeout;
  auto nap = std::chrono::microseconds(1);
  while (!lane.words->isSet(emptied)) {
    if (Clock::now() >= deadline) {
      fail(op.describe(), " failed: its receiver has not taken the message ", kEagerSlots,
           " before it on this tag (eager slot ", slot.slot, ") within the group timeout of ",
           timeout.count(), " ms");
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(20));
  }
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
  if (!enabled() || ring->slots() != kEagerSlots) return;
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
  const size_t fromPeer = std::count_if(incoming_.begin(), incoming_.end(), [&](const auto& in) {
    return in.first.peer == lane.peer;
  });
  if (fromPeer >= kLanesPerPeer) return nullptr;
  Incoming& in = incoming_[lane];
  try {
    in.ring = std::make_shared<StagingRing>(flags_, device, slotBytes_, kEagerSlots);
    log(LogLevel::kInfo, "eager ring of ", kEagerSlots, " x ", slotBytes_, " B on cuda:", device,
        " for group ", lane.group, " tag ", lane.tag, " from ", lane.peer);
  } catch (const Error& error) {
    log(LogLevel::kInfo, "no eager ring on cuda:", device, " for group ", lane.group, " tag ",
        lane.tag, " from ", lane.peer, " (", error.what(), "): its sends wait for the recvs");
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
    if (front && front->claim.load() == EagerRecv::kOpen) break;
    line.erase(line.begin());
  }
  line.emplace(recv->seq, recv);
}

std::shared_ptr<StagingRing> EagerLanes::predict(const EagerRecv& recv) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return predictLocked(recv);
}

std::shared_ptr<StagingRing> EagerLanes::predictLocked(const EagerRecv& recv) const {
  const auto known = incoming_.find(recv.lane);
  if (known == incoming_.end() || !known->second.ring) return nullptr;
  // Every message from the first eager one on is eager if it fits, as the recv does.
  if (recv.seq < known->second.firstEager || recv.buffer.bytes == 0 ||
      recv.buffer.bytes > known->second.ring->slotBytes()) {
    return nullptr;
  }
  return known->second.ring;
}

bool EagerLanes::claimable(const EagerRecv& recv) const {
  const int claim = recv.claim.load();
  return claim == EagerRecv::kByCaller || (claim == EagerRecv::kOpen && predict(recv));
}

bool EagerLanes::queueCopiesOut(EagerRecv& recv, CUstream stream) {
  std::vector<std::pair<std::shared_ptr<EagerRecv>, std::shared_ptr<StagingRing>>> earlier;
  std::shared_ptr<StagingRing> ring;
  if (recv.claim.load() != EagerRecv::kByCaller) {
    std::lock_guard<std::mutex> lock(mutex_);
    ring = predictLocked(recv);
    if (!ring) return false;
    auto& line = posted_[recv.lane];
    for (auto it = line.begin(); it != line.end() && it->first < recv.seq;) {
      auto other = it->second.lock();
      if (other && other->claim.load() == EagerRecv::kOpen) {
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
  cuda::check(cuda::driver().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(recv.buffer.data),
                                           recv.ring->slotAddress(eager.staged.slot),
                                           recv.buffer.bytes, stream),
              "cuMemcpyAsync (out of an eager slot)");
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
  return static_cast<int64_t>(incoming_.size() + outgoing_.size());
}

}  // namespace smfree::engine
