#include "engine/cuda/Copies.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "engine/cuda/Capture.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/Event.h"

namespace smfree::engine::cuda {
namespace {

// Streams whose bounce is kept; beyond, the least recently used one's goes back to the pool
// (once its last pass has run): a program that makes a stream per step must not hold a bounce
// for each.
constexpr size_t kStreamsKept = 16;

void queueOne(CUstream stream, CUdeviceptr to, CUdeviceptr from, uint64_t bytes,
              const char* what) {
  check(driver().cuMemcpyAsync(to, from, bytes, stream), what);
}

void queueBounced(CUstream stream, const Place& to, const Place& from, uint64_t bytes,
                  const Bounce& bounce, const char* what) {
  for (uint64_t at = 0; at < bytes; at += bounce.bytes()) {
    const uint64_t chunk = std::min(bounce.bytes(), bytes - at);
    queueOne(stream, bounce.address(), from.address + at, chunk, what);
    queueOne(stream, to.address + at, bounce.address(), chunk, what);
  }
}

// A stream's bounce, and the event after its last pass.
struct StreamBounce {
  std::mutex mutex;  // held while its hops are queued: two threads may share a stream
  std::unique_ptr<BounceLease> lease;
  std::shared_ptr<Event> lastUse;
  uint64_t usedAt = 0;

  ~StreamBounce() {
    if (lease) lease->usedUntil(std::move(lastUse));
  }
};

class StreamBounces {
 public:
  void copy(CUstream stream, int streamDevice, const Place& to, const Place& from,
            uint64_t bytes, const char* what) {
    const std::shared_ptr<StreamBounce> entry = entryFor(stream, streamDevice);
    // Not under mutex_: queueing may block while the stream's hardware queue is full, and
    // other streams' copies must go on meanwhile.
    std::lock_guard<std::mutex> lock(entry->mutex);
    const Bounce* kept = entry->lease ? &entry->lease->bounce() : nullptr;
    if (!kept || kept->device() != to.device || kept->bytes() < bounceBytesFor(bytes)) {
      if (entry->lease) entry->lease->usedUntil(entry->lastUse);
      entry->lease = std::make_unique<BounceLease>(to.device, bytes);
    }
    queueBounced(stream, to, from, bytes, entry->lease->bounce(), what);
    entry->lastUse = takeEvent(streamDevice);
    entry->lastUse->record(stream);
  }

 private:
  std::shared_ptr<StreamBounce> entryFor(CUstream stream, int streamDevice) {
    unsigned long long id = 0;  // unique per stream, unlike its handle, which is reused
    check(driver().cuStreamGetId(stream, &id), "cuStreamGetId");
    std::lock_guard<std::mutex> lock(mutex_);
    auto& entry = byStream_[{streamDevice, id}];
    if (!entry) {
      entry = std::make_shared<StreamBounce>();
      if (byStream_.size() > kStreamsKept) evictLeastRecent();
    }
    entry->usedAt = ++clock_;
    return entry;
  }

  // Its bounce goes back once no thread queues on it (the last holder of the entry).
  void evictLeastRecent() {  // under mutex_
    const auto oldest = std::min_element(byStream_.begin(), byStream_.end(),
                                         [](const auto& a, const auto& b) {
                                           return a.second->usedAt < b.second->usedAt;
                                         });
    byStream_.erase(oldest);
  }

  std::mutex mutex_;
  std::map<std::pair<int, unsigned long long>, std::shared_ptr<StreamBounce>> byStream_;
  uint64_t clock_ = 0;
};

StreamBounces& streamBounces() {
  // Never destroyed: copies may still run at process exit, when the driver may be gone.
  static auto* bounces = new StreamBounces();
  return *bounces;
}

}  // namespace

namespace {
std::atomic<LocalCopies> localCopiesSetting{LocalCopies::kDriver};
}  // namespace

void setLocalCopies(LocalCopies how) { localCopiesSetting.store(how); }

LocalCopies localCopies() { return localCopiesSetting.load(); }

const char* describe(LocalCopies how) {
  switch (how) {
    case LocalCopies::kPeerGpu:
      return "two copy-engine hops through a peer GPU's memory (SMFREE_LOCAL_COPIES=peer_gpu)";
    case LocalCopies::kHost:
      return "two copy-engine hops through pinned host memory (SMFREE_LOCAL_COPIES=host)";
    case LocalCopies::kDriver:
      break;
  }
  return "the driver's copies, which CUDA 13.0 drivers run on SMs (SMFREE_LOCAL_COPIES=driver)";
}

bool bounced(const Place& to, const Place& from) {
  return localCopies() != LocalCopies::kDriver && to.device != kHostMemory &&
         to.device == from.device;
}

void queueCopy(CUstream stream, int streamDevice, const Place& to, const Place& from,
               uint64_t bytes, const char* what) {
  ContextGuard context(streamDevice);
  if (!bounced(to, from)) {
    queueOne(stream, to.address, from.address, bytes, what);
    return;
  }
  streamBounces().copy(stream, streamDevice, to, from, bytes, what);
}

void queueCopyThrough(CUstream stream, int streamDevice, const Place& to, const Place& from,
                      uint64_t bytes, std::unique_ptr<BounceLease>& through, const char* what) {
  RelaxedCapture relaxed;  // leasing may allocate or query an event while `stream` captures
  ContextGuard context(streamDevice);
  if (!bounced(to, from)) {
    queueOne(stream, to.address, from.address, bytes, what);
    return;
  }
  if (!through) through = std::make_unique<BounceLease>(to.device, bytes);
  queueBounced(stream, to, from, bytes, through->bounce(), what);
}

void keepWithGraph(CUgraph graph, std::unique_ptr<BounceLease> lease) {
  // Released, not freed, if the graph does not take it: its nodes use the bounce, which must
  // then never go back to the pool.
  BounceLease* kept = lease.release();
  onGraphDestroyed(graph, [kept]() { delete kept; });
}

}  // namespace smfree::engine::cuda
