#pragma once

#include <cuda.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/channels/copy_engine/RingMemory.h"
#include "engine/cuda/DeviceMemory.h"
#include "engine/cuda/FlagSegment.h"
#include "engine/cuda/IpcCache.h"
#include "engine/cuda/IpcExport.h"

namespace smfree::engine {

// A ring of slots in the receiver's GPU memory, per (sender process, receiver device), that a
// sender's copy engine writes into and the receiver's copies out of. Two uses (see
// CopyEngineChannel.h):
//  - staging: a cleared send whose receiver's stream has not yet freed the destination goes
//    to a slot. This takes the receiver's `ready` hop off the sender's copy engine (measured
//    at 16 MiB on H200: 59.3 µs per op with the hop, 50.1 µs staged);
//  - eager sends: a small send is copied into a slot at its post, before any receiver has
//    matched it, so that neither side's CPU waits for the other's.
//
// Each slot has one word in the receiver's flag segment. Use `u` of a slot raises it to
// full(u) when the sender's copy has landed and to emptied(u) when the receiver has copied
// it out; the sender's CPU reuses a slot once it reads emptied(u - 1). An eager ring's slot
// has a second word, its way: which way each use's message goes (EagerLanes.h).
struct StagedSlot {
  uint32_t slot = 0;
  uint32_t use = 0;
};

cuda::Flag slotFull(const cuda::Flag& word, uint32_t use);
cuda::Flag slotEmptied(const cuda::Flag& word, uint32_t use);

// Slots per staging ring. A third slot measured no faster than two.
constexpr uint32_t kStagingSlots = 2;
// Slots per eager ring: how many small sends a sender may have in a receiver's memory before
// its next one goes by rendezvous (or waits, held, for its slot). A pipeline stage sends one
// activation or gradient per micro-batch; 8 lets a sender run that many micro-batches ahead.
constexpr uint32_t kEagerSlots = 8;
// Below this a staged op costs more than the hop it saves: its receiver learns that its
// buffer is being filled from a control message instead of a word in shared memory, and at
// 4 MiB that round trip, not the GPU, sets the pace (H200 one way: 26.6 µs per 4 MiB op
// staged, 20.8 µs for NCCL).
constexpr uint64_t kStagingMinBytes = 8ull << 20;

// The receiver's side: the slots' memory and words.
class StagingRing {
 public:
  // Throws Error when the memory (within `memory`'s bound) or the words cannot be had. `ways`:
  // a way word per slot. `what` names the ring in the log.
  StagingRing(cuda::FlagSegment& flags, RingMemory& memory, int device, uint64_t slotBytes,
              uint32_t slots, bool ways, const std::string& what);
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // What the sender needs to use the ring; it travels with a clear-to-send.
  void appendTo(std::string& out) const;
  CUdeviceptr slotAddress(uint32_t slot) const;
  cuda::Flag full(const StagedSlot& staged) const { return slotFull(words_[staged.slot], staged.use); }
  cuda::Flag emptied(const StagedSlot& staged) const {
    return slotEmptied(words_[staged.slot], staged.use);
  }
  // The slot's way word; only on a ring made with `ways`.
  const cuda::Flag& wayOf(uint32_t slot) const { return ways_.at(slot); }
  // The sender is gone: lets every copy-out parked on its slots run (into recvs that failed).
  void releaseWaits() const;
  int device() const { return memory_.device(); }
  uint64_t slotBytes() const { return slotBytes_; }
  uint32_t slots() const { return static_cast<uint32_t>(words_.size()); }
  uint64_t bytes() const { return slotBytes_ * words_.size(); }

 private:
  cuda::FlagSegment& flags_;
  uint64_t slotBytes_;
  std::unique_ptr<RingMemory::Share> share_;  // before memory_: taken first, given back last
  cuda::DeviceMemory memory_;
  // Never released: releaseWaits() may leave a word above what the segment would hand out
  // next for it, and way words only grow.
  std::vector<cuda::Flag> words_;
  std::vector<cuda::Flag> ways_;
  cuda::IpcExport exported_;
};

// The sender's side: a receiver's ring, mapped per local device on first use.
class RemoteStagingRing {
 public:
  // The most slots a peer's ring may say it has.
  static constexpr uint32_t kMaxRemoteSlots = 64;
  static constexpr uint64_t kMaxRemoteSlotBytes = uint64_t{1} << 40;
  // Reads what StagingRing::appendTo wrote; throws BadPeerValue (PeerValue.h) on malformed
  // bytes or a word out of the flag segment. Its geometry is checked against its memory where
  // that is mapped (slotAddress()).
  static std::shared_ptr<RemoteStagingRing> read(const char* data, size_t size);

  // The next slot in turn if the receiver has emptied its last use.
  std::optional<StagedSlot> nextFree(const cuda::RemoteFlagSegment& words) const;
  // Marks the slot returned by nextFree() as used.
  void take(const StagedSlot& staged);
  CUdeviceptr slotAddress(const StagedSlot& staged, int localDevice);
  cuda::Flag full(const StagedSlot& staged) const { return slotFull(words_[staged.slot], staged.use); }

  int device() const { return exported_.device; }
  uint64_t bufferId() const { return exported_.bufferId; }
  uint64_t slotBytes() const { return slotBytes_; }
  uint32_t slots() const { return static_cast<uint32_t>(words_.size()); }
  const cuda::Flag& wordOf(uint32_t slot) const { return words_[slot]; }
  bool hasWays() const { return !ways_.empty(); }
  const cuda::Flag& wayOf(uint32_t slot) const { return ways_.at(slot); }

 private:
  uint64_t slotBytes_ = 0;
  std::vector<cuda::Flag> words_;
  std::vector<cuda::Flag> ways_;
  cuda::IpcExport exported_;
  std::vector<uint32_t> uses_;  // per slot, uses taken so far
  uint32_t next_ = 0;
  std::map<int, std::unique_ptr<cuda::PeerMapping>> mappings_;  // by local device
};

}  // namespace smfree::engine
