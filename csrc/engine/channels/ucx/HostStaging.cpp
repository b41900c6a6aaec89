#include "engine/channels/ucx/HostStaging.h"

#include <mutex>

#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine {
namespace {

// Pipeline stages send tensors of the same few sizes again and again; allocating pinned
// memory costs milliseconds, so idle buffers are kept, up to this much.
constexpr uint64_t kMaxCachedBytes = uint64_t{256} << 20;
constexpr uint64_t kGranule = uint64_t{64} << 10;

}  // namespace

// Idle buffers by size. Shared with the deleters of the buffers handed out, which may run
// after the HostStaging is gone (a UCX request freed late): they then free the memory.
struct HostStaging::Cache {
  std::mutex mutex;
  std::multimap<uint64_t, std::unique_ptr<cuda::PinnedMemory>> idle;
  uint64_t idleBytes = 0;

  void giveBack(std::unique_ptr<cuda::PinnedMemory> memory) {
    std::lock_guard<std::mutex> lock(mutex);
    if (idleBytes + memory->bytes() > kMaxCachedBytes) return;  // freed here
    idleBytes += memory->bytes();
    const uint64_t bytes = memory->bytes();
    idle.emplace(bytes, std::move(memory));
  }

  // The smallest idle buffer that holds `bytes` without wasting more than as much again.
  std::unique_ptr<cuda::PinnedMemory> reuse(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = idle.lower_bound(bytes);
    if (it == idle.end() || it->first > 2 * bytes) return nullptr;
    std::unique_ptr<cuda::PinnedMemory> memory = std::move(it->second);
    idle.erase(it);
    idleBytes -= memory->bytes();
    return memory;
  }
};

HostStaging::HostStaging() : cache_(std::make_shared<Cache>()) {}

std::shared_ptr<cuda::PinnedMemory> HostStaging::take(int device, uint64_t bytes) {
  std::unique_ptr<cuda::PinnedMemory> memory = cache_->reuse(bytes);
  if (!memory) {
    const uint64_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
    memory = std::make_unique<cuda::PinnedMemory>(device, rounded);
  }
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
    log(LogLevel::kInfo, "host staging stream for cuda:", device, " (", direction, ")");
  }
  return *stream;
}

std::shared_ptr<cuda::Event> HostStaging::copyToHost(const Buffer& from,
                                                     const cuda::PinnedMemory& to) {
  const cuda::Stream& stream = streamOf(toHost_, from.device, "to host");
  cuda::ContextGuard context(from.device);
  cuda::check(cuda::driver().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(to.data()),
                                           reinterpret_cast<CUdeviceptr>(from.data),
                                           from.bytes, stream.handle()),
              "cuMemcpyAsync (device to host staging)");
  std::shared_ptr<cuda::Event> copied = cuda::takeEvent(from.device);
  copied->record(stream.handle());
  return copied;
}

std::shared_ptr<cuda::Event> HostStaging::copyToDevice(const cuda::PinnedMemory& from,
                                                       const Buffer& to) {
  const cuda::Stream& stream = streamOf(toDevice_, to.device, "to device");
  cuda::ContextGuard context(to.device);
  cuda::check(cuda::driver().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(to.data),
                                           reinterpret_cast<CUdeviceptr>(from.data()),
                                           to.bytes, stream.handle()),
              "cuMemcpyAsync (host staging to device)");
  std::shared_ptr<cuda::Event> copied = cuda::takeEvent(to.device);
  copied->record(stream.handle());
  return copied;
}

uint64_t HostStaging::cachedBytes() const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  return cache_->idleBytes;
}

}  // namespace smfree::engine
