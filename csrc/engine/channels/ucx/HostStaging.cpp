#include "engine/channels/ucx/HostStaging.h"

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
constexpr const char* kToHost = "device to host staging";
constexpr const char* kToDevice = "host staging to device";

struct PieceSpan {
  uint64_t offset;
  uint64_t bytes;
};

PieceSpan spanOf(const CallerStaging& staging, uint32_t piece) {
  if (staging.pieceBytes == 0) return {0, staging.bytes};
  const uint64_t offset = piece * staging.pieceBytes;
  return {offset, std::min(staging.pieceBytes, staging.bytes - offset)};
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

uint64_t stagingPieceBytes(uint64_t bytes, uint64_t preferred) {
  if (preferred == 0 || bytes <= preferred) return 0;
  return std::max(preferred, (bytes + kMostStagingPieces - 1) / kMostStagingPieces);
}

uint64_t stagingPieceCount(uint64_t bytes, uint64_t pieceBytes) {
  return pieceBytes == 0 ? 1 : (bytes + pieceBytes - 1) / pieceBytes;
}

// Idle buffers by size class. Allocating pinned memory costs milliseconds (a 256 MiB buffer
// per op made 256 MiB sends 5 x slower), so buffers are kept, as PyTorch keeps its pinned
// host blocks: what is cached never exceeds what was in use at once, per class. Shared with
// the deleters of the buffers handed out, which may run after the HostStaging is gone (a UCX
// request freed late): they then free the memory.
struct HostStaging::Cache {
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

HostStaging::HostStaging() : cache_(std::make_shared<Cache>()) {}

std::shared_ptr<cuda::PinnedMemory> HostStaging::take(int device, uint64_t bytes) {
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

cuda::Stream& HostStaging::streamOf(Streams& streams, int device, const char* direction) {
  auto& stream = streams[device];
  if (!stream) {
    stream = std::make_unique<cuda::Stream>(device);
    log(LogLevel::kInfo, "stream for cuda:", device, " (", direction, ")");
  }
  return *stream;
}

std::shared_ptr<cuda::Event> HostStaging::copy(Streams& streams, int device, const char* direction,
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

std::shared_ptr<cuda::Event> HostStaging::copyToDevice(const cuda::PinnedMemory& from,
                                                       const Buffer& to, uint64_t offset,
                                                       uint64_t bytes) {
  return copy(toDevice_, to.device, kToDevice,
              static_cast<char*>(to.data) + offset, static_cast<char*>(from.data()) + offset,
              bytes);
}

void HostStaging::copyToDeviceAfter(int device, const cuda::Event& event) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  event.waitOn(streamOf(toDevice_, device, kToDevice).handle());
}

void HostStaging::recordAfterCopiesToDevice(int device, cuda::Event& event) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  event.record(streamOf(toDevice_, device, kToDevice).handle());
}

void HostStaging::copyOutInPieces(const CallerStaging& staging, cuda::FlagSegment& flags) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  const CUstream stream = streamOf(toHost_, staging.device, kToHost).handle();
  cuda::ContextGuard context(staging.device);
  staging.reached->waitOn(stream);
  void* progress = flags.cudaAddress(staging.progress.index);
  for (uint32_t piece = 0; piece < staging.pieces; ++piece) {
    const PieceSpan span = spanOf(staging, piece);
    copyOn(stream, staging.device, kToHost, addressIn(staging.host->data(), span.offset),
           addressIn(staging.data, span.offset), span.bytes);
    cuda::writeWord(stream, progress, staging.progress.value + piece,
                    "cuStreamWriteValue32 (staged piece out)");
  }
  staging.copied->record(stream);
}

void HostStaging::copyInAsPiecesLand(const CallerStaging& staging, cuda::FlagSegment& flags) {
  std::lock_guard<std::mutex> lock(streamsMutex_);
  const CUstream stream = streamOf(toDevice_, staging.device, kToDevice).handle();
  cuda::ContextGuard context(staging.device);
  staging.reached->waitOn(stream);
  void* landed = flags.cudaAddress(staging.progress.index);
  for (uint32_t piece = 0; piece < staging.pieces; ++piece) {
    const PieceSpan span = spanOf(staging, piece);
    cuda::waitAtLeast(stream, landed, staging.progress.value + piece,
                      "cuStreamWaitValue32 (staged piece landed)");
    copyOn(stream, staging.device, kToDevice, addressIn(staging.data, span.offset),
           addressIn(staging.host->data(), span.offset), span.bytes);
  }
  cuda::writeWord(stream, flags.cudaAddress(staging.copiedIn.index), staging.copiedIn.value,
                  "cuStreamWriteValue32 (staged copies in)");
  staging.copied->record(stream);
}

uint64_t HostStaging::cachedBytes() const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  return cache_->idleBytes;
}

}  // namespace smfree::engine
