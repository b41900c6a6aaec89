#include "engine/channels/ucx/HostStaging.h"

#include <mutex>
#include <vector>

#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

// Buffers come in power-of-two sizes from 64 KiB, so a buffer serves every size of its class.
constexpr uint64_t kSmallestClass = uint64_t{64} << 10;

// The two directions, as the logs and errors name them.
constexpr const char* kToHost = "device to host staging";
constexpr const char* kToDevice = "host staging to device";

uint64_t sizeClass(uint64_t bytes) {
  uint64_t size = kSmallestClass;
  while (size < bytes) size *= 2;
  return size;
}

}  // namespace

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
  const cuda::Stream& stream = streamOf(streams, device, direction);
  cuda::ContextGuard context(device);
  cuda::check(cuda::driver().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(to),
                                           reinterpret_cast<CUdeviceptr>(from), bytes,
                                           stream.handle()),
              concat("cuMemcpyAsync (", direction, ")").c_str());
  std::shared_ptr<cuda::Event> copied = cuda::takeEvent(device);
  copied->record(stream.handle());
  return copied;
}

std::shared_ptr<cuda::Event> HostStaging::copyToHost(const Buffer& from,
                                                     const cuda::PinnedMemory& to,
                                                     uint64_t offset, uint64_t bytes) {
  return copy(toHost_, from.device, kToHost,
              static_cast<char*>(to.data()) + offset, static_cast<char*>(from.data) + offset,
              bytes);
}

std::shared_ptr<cuda::Event> HostStaging::copyToDevice(const cuda::PinnedMemory& from,
                                                       const Buffer& to, uint64_t offset,
                                                       uint64_t bytes) {
  return copy(toDevice_, to.device, kToDevice,
              static_cast<char*>(to.data) + offset, static_cast<char*>(from.data()) + offset,
              bytes);
}

void HostStaging::copyToHostAfter(int device, const cuda::Event& event) {
  event.waitOn(streamOf(toHost_, device, kToHost).handle());
}

void HostStaging::copyToDeviceAfter(int device, const cuda::Event& event) {
  event.waitOn(streamOf(toDevice_, device, kToDevice).handle());
}

void HostStaging::recordAfterCopiesToHost(int device, cuda::Event& event) {
  event.record(streamOf(toHost_, device, kToHost).handle());
}

void HostStaging::recordAfterCopiesToDevice(int device, cuda::Event& event) {
  event.record(streamOf(toDevice_, device, kToDevice).handle());
}

uint64_t HostStaging::cachedBytes() const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  return cache_->idleBytes;
}

}  // namespace smfree::engine
