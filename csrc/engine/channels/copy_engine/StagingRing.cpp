#include "engine/channels/copy_engine/StagingRing.h"

#include <cstring>

#include "engine/Error.h"
#include "engine/PeerValue.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

// The fixed part of a ring on the wire; its slot words, its way words (if `ways`), then its
// memory's export, follow.
struct RingHeader {
  uint64_t slotBytes;
  uint32_t slots;
  uint32_t ways;  // 0 or 1
};

}  // namespace

cuda::Flag slotFull(const cuda::Flag& word, uint32_t use) { return word.plus(2 * use); }

cuda::Flag slotEmptied(const cuda::Flag& word, uint32_t use) { return word.plus(2 * use + 1); }

StagingRing::StagingRing(cuda::FlagSegment& flags, RingMemory& memory, int device,
                         uint64_t slotBytes, uint32_t slots, bool ways, const std::string& what)
    : flags_(flags),
      slotBytes_(slotBytes),
      share_(memory.take(device, slotBytes * slots, what)),
      memory_(device, slotBytes * slots) {
  for (uint32_t slot = 0; slot < slots; ++slot) words_.push_back(flags_.acquire());
  if (ways) {
    for (uint32_t slot = 0; slot < slots; ++slot) ways_.push_back(flags_.acquire());
  }
  exported_ = memory_.exportIpc();
}

void StagingRing::appendTo(std::string& out) const {
  const RingHeader header{slotBytes_, static_cast<uint32_t>(words_.size()),
                          ways_.empty() ? 0u : 1u};
  out.append(reinterpret_cast<const char*>(&header), sizeof(header));
  out.append(reinterpret_cast<const char*>(words_.data()), words_.size() * sizeof(cuda::Flag));
  out.append(reinterpret_cast<const char*>(ways_.data()), ways_.size() * sizeof(cuda::Flag));
  exported_.appendTo(out);
}

CUdeviceptr StagingRing::slotAddress(uint32_t slot) const {
  return memory_.address() + static_cast<CUdeviceptr>(slot) * slotBytes_;
}

void StagingRing::releaseWaits() const {
  // Far above any use a wait can be for, yet within the half range that GEQ compares.
  constexpr uint32_t kBeyondAnyUse = 1u << 30;
  for (const cuda::Flag& word : words_) {
    flags_.set(cuda::Flag{word.index, flags_.wordOf(word) + kBeyondAnyUse});
  }
}

std::shared_ptr<RemoteStagingRing> RemoteStagingRing::read(const char* data, size_t size) {
  constexpr const char* kMessage = "staging ring";
  RingHeader header{};
  if (size < sizeof(header)) {
    badPeerValue(kMessage, "length", size, " B, shorter than its ", sizeof(header), " B header");
  }
  std::memcpy(&header, data, sizeof(header));
  if (header.slots == 0 || header.slots > kMaxRemoteSlots) {
    badPeerValue(kMessage, "slot count", header.slots, " is not 1 to ", kMaxRemoteSlots);
  }
  checkBelow(kMessage, "ways", header.ways, 2);
  // Slots of at most 1 TiB: their product with the count cannot overflow.
  if (header.slotBytes == 0 || header.slotBytes > kMaxRemoteSlotBytes) {
    badPeerValue(kMessage, "slot bytes", header.slotBytes, " is not 1 to ", kMaxRemoteSlotBytes);
  }
  const size_t slotWordBytes = static_cast<size_t>(header.slots) * sizeof(cuda::Flag);
  const size_t wordBytes = slotWordBytes * (header.ways ? 2 : 1);
  if (size < sizeof(header) + wordBytes) {
    badPeerValue(kMessage, "length", size, " B for ", header.slots, " slots' words");
  }
  auto ring = std::make_shared<RemoteStagingRing>();
  ring->slotBytes_ = header.slotBytes;
  ring->words_.resize(header.slots);
  std::memcpy(ring->words_.data(), data + sizeof(header), slotWordBytes);
  if (header.ways) {
    ring->ways_.resize(header.slots);
    std::memcpy(ring->ways_.data(), data + sizeof(header) + slotWordBytes, slotWordBytes);
  }
  for (const cuda::Flag& word : ring->words_) checkFlag(kMessage, "slot flag index", word);
  for (const cuda::Flag& way : ring->ways_) checkFlag(kMessage, "way flag index", way);
  ring->exported_ = cuda::IpcExport::read(data + sizeof(header) + wordBytes,
                                          size - sizeof(header) - wordBytes);
  if (ring->exported_.kind != cuda::IpcExport::Kind::kIpcHandle) {
    badPeerValue(kMessage, "export kind", "its memory is not exported as an IPC handle");
  }
  ring->uses_.assign(header.slots, 0);
  return ring;
}

std::optional<StagedSlot> RemoteStagingRing::nextFree(const cuda::RemoteFlagSegment& words) const {
  const StagedSlot staged{next_, uses_[next_]};
  if (staged.use > 0 && !words.isSet(slotEmptied(words_[staged.slot], staged.use - 1))) {
    return std::nullopt;
  }
  return staged;
}

void RemoteStagingRing::take(const StagedSlot& staged) {
  uses_[staged.slot] = staged.use + 1;
  next_ = (staged.slot + 1) % static_cast<uint32_t>(uses_.size());
}

CUdeviceptr RemoteStagingRing::slotAddress(const StagedSlot& staged, int localDevice) {
  auto& mapping = mappings_[localDevice];
  if (!mapping) {
    auto mapped = std::make_unique<cuda::PeerMapping>(exported_, -1, localDevice);
    // The ring's geometry against the memory mapped: every slot's copy lands inside it.
    mapped->addressOf(exported_, slotBytes_ * uses_.size());
    mapping = std::move(mapped);
  }
  return mapping->address() + static_cast<CUdeviceptr>(staged.slot) * slotBytes_;
}

}  // namespace smfree::engine
