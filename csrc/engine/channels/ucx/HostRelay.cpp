#include "engine/channels/ucx/HostRelay.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "engine/Log.h"
#include "engine/cuda/Copies.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/StreamMemoryOps.h"

namespace smfree::engine {
namespace {

// Buffers come in power-of-two sizes from 64 KiB, so a buffer serves every size of its class.
constexpr uint64_t kSmallestClass = uint64_t{64} << 10;

// The two directions, as the logs and errors name them.
constexpr const char* kToHost = "device to host relay";
constexpr const char* kToDevice = "host relay to device";

struct PieceSpan {
  uint64_t offset;
  uint64_t bytes;
};

PieceSpan spanOf(const CallerRelay& relay, uint32_t piece) {
  if (relay.pieceBytes == 0) return {0, relay.bytes};
  const uint64_t offset = piece * relay.pieceBytes;
  return {offset, std::min(relay.pieceBytes, relay.bytes - offset)};
}

void* addressIn(void* base, uint64_t offset) { return static_cast<char*>(base) + offset; }

// Between `device`'s memory and pinned host memory, `direction` (kToHost or kToDevice).
void copyOn(CUstream stream, int device, const char* direction, const void* to,
            const void* from, uint64_t bytes) {
  const bool toHost = direction == kToHost;
  const auto target = cuda::Place::of(to, toHost ? cuda::kHostMemory : device);
  const auto source = cuda::Place::of(from, toHost ? device : cuda::kHostMemory);
  cuda::queueCopy(stream, device, target, source, bytes,
                  concat("cuMemcpyAsync (", direction, ")").c_str());
}

uint64_t sizeClass(uint64_t bytes) {
  uint64_t size = kSmallestClass;
  while (size < bytes) size *= 2;
  return size;
}

}  // namespace

uint64_t relayPieceBytes(uint64_t bytes, uint64_t preferred) {
  if (preferred == 0 || bytes <= preferred) return 0;
  return std::max(preferred, (bytes + kMostRelayPieces - 1) / kMostRelayPieces);
}

uint64_t relayPieceCount(uint64_t bytes, uint64_t pieceBytes) {
  return pieceBytes == 0 ? 1 : (bytes + pieceBytes - 1) / pieceBytes;
}

// Idle buffers by size class. Allocating pinned memory costs milliseconds (a 256 MiB buffer
// per op made 256 MiB sends 5 x slower), so buffers are kept, as PyTorch keeps its pinned
// host blocks: what is cached never exceeds what was in use at once, per class. Shared with
// the deleters of the buffers handed out, which may run after the HostRelay is gone (a UCX
// request freed late): they then free the memory.
struct HostRelay::Cache {
  std::mutex mutex;
  std::map<uint64_t, std::vector<std::unique_ptr<cuda::PinnedMemory>>> idle;
  uint64_t idleBytes = 0;

  void giveBack(std::unique_ptr<cuda::PinnedMemory> memory) {
    std::lock_guard<std::mutex> lock(mutex);
    idleBytes += memory->bytes();
    idle[memory->bytes()].push_back(std::move(memory));
  }

  std::unique_ptr<cuda::PinnedMemory> reuse(uint64_t size) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = idle.find(size);
    if (it == idle.end() || it->second.empty()) return nullptr;
    std::unique_ptr<cuda::PinnedMemory> memory = std::move(it->second.back());
    it->second.pop_back();
    idleBytes -= memory->bytes();
    return memory;
  }
};

HostRelay::HostRelay() : cache_(std::make_shared<Cache>()) {}

std::shared_ptr<cuda::PinnedMemory> HostRelay::take(int device, uint64_t bytes) {
  const uint64_t size = sizeClass(bytes);
  std::unique_ptr<cuda::PinnedMemory> memory = cache_->reuse(size);
  if (!memory) memory = std::make_unique<cuda::PinnedMemory>(device, size);
  std::weak_ptr<Cache> cache = cache_;
  return std::shared_ptr<cuda::PinnedMemory>(
      memory.release(), [cache](cuda::PinnedMemory* released) {
        std::unique_ptr<cuda::PinnedMemory> owned(released);
        if (auto live = cache.lock()) live->giveBack(std::move(owned));
      });
}

cuda::Stream& HostRelay::streamOf(Streams& streams, int device, const char* direction) {
  auto& stream = streams[device];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(device);
    log(LogLevel::kInfo, "stream for cuda:", device, " (", direction, ")");
  }
  return *stream;
}

std::shared_ptr<cuda::Event> HostRelay::copy(Streams& streams, int device, const char* direction,
                                               const void* to, const void* from,
                                               uint64_t bytes) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  const cuda::Stream& stream = streamOf(streams, device, direction);
  cuda::ContextGuard context(device);
  copyOn(stream.handle(), device, direction, to, from, bytes);
  std::shared_ptr<cuda::Event> copied = cuda::takeEvent(device);
  copied->record(stream.handle());
  return copied;
}

std::shared_ptr<cuda::Event> HostRelay::copyToDevice(const cuda::PinnedMemory& from,
                                                       const Buffer& to, uint64_t offset,
                                                       uint64_t bytes) {
  return copy(toDevice_, to.device, kToDevice,
              static_cast<char*>(to.data) + offset, static_cast<char*>(from.data()) + offset,
              bytes);
}

void HostRelay::copyToDeviceAfter(int device, const cuda::Event& event) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  event.waitOn(streamOf(toDevice_, device, kToDevice).handle());
}

void HostRelay::recordAfterCopiesToDevice(int device, cuda::Event& event) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  event.record(streamOf(toDevice_, device, kToDevice).handle());
}

void HostRelay::copyOutInPieces(const CallerRelay& relay, cuda::FlagSegment& flags) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  const CUstream stream = streamOf(toHost_, relay.device, kToHost).handle();
  cuda::ContextGuard context(relay.device);
  relay.reached->waitOn(stream);
  void* progress = flags.cudaAddress(relay.progress.index);
  for (uint32_t piece = 0; piece < relay.pieces; ++piece) {
    const PieceSpan span = spanOf(relay, piece);
    copyOn(stream, relay.device, kToHost, addressIn(relay.host->data(), span.offset),
           addressIn(relay.data, span.offset), span.bytes);
    cuda::writeWord(stream, progress, relay.progress.value + piece,
                    "cuStreamWriteValue32 (relayed piece out)");
  }
  relay.copied->record(stream);
}

void HostRelay::copyInAsPiecesLand(const CallerRelay& relay, cuda::FlagSegment& flags) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  const CUstream stream = streamOf(toDevice_, relay.device, kToDevice).handle();
  cuda::ContextGuard context(relay.device);
  relay.reached->waitOn(stream);
  void* landed = flags.cudaAddress(relay.progress.index);
  for (uint32_t piece = 0; piece < relay.pieces; ++piece) {
    const PieceSpan span = spanOf(relay, piece);
    cuda::waitAtLeast(stream, landed, relay.progress.value + piece,
                      "cuStreamWaitValue32 (relayed piece landed)");
    copyOn(stream, relay.device, kToDevice, addressIn(relay.data, span.offset),
           addressIn(relay.host->data(), span.offset), span.bytes);
  }
  cuda::writeWord(stream, flags.cudaAddress(relay.copiedIn.index), relay.copiedIn.value,
                  "cuStreamWriteValue32 (relayed copies in)");
  relay.copied->record(stream);
}

uint64_t HostRelay::cachedBytes() const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  return cache_->idleBytes;
}

}  // namespace smfree::engine
