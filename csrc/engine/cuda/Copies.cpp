#include "engine/cuda/Copies.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "engine/Error.h"
#include "engine/cuda/Capture.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/Stream.h"

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

// A second stream beside a caller's stream, for the odd chunks of a long copy, and the
// events that start and end its share. Its work waits only for the caller's stream, which waits
// for all of it at the copy's end: the copy keeps the caller stream's order, and no wait on
// anything else enters it.
struct SideStream {
  explicit SideStream(int device)
      // Released, not drained, when dropped: its hops follow the caller's stream, which may
      // wait on a peer's flag that never comes.
      : stream(device, Stream::OnDestroy::kRelease), started(device), done(device) {}

  Stream stream;
  Event started;  // the first chunk's first hop, on the caller's stream
  Event done;     // its last hop
};

// Both hops of each chunk of kChunkBytes. Without `second`, all on `stream`, one chunk after
// the other through the bounce's first half. With it, the even chunks so and the odd ones on
// `second`'s stream through the other half, starting once the first chunk's first hop is done:
// the two streams then run a hop apart, one's hop into the bounce beside the other's hop out of
// it, on the two directions of the link. The streams hand over only at their start and end: a
// handover between streams cost about 13 µs on H200, so handing over every chunk gained nothing
// at 16 MiB chunks and lost much at smaller ones (tools/probe_bounce.py).
void queueBounced(CUstream stream, const Place& to, const Place& from, uint64_t bytes,
                  const Bounce& bounce, SideStream* second, const char* what) {
  const uint64_t streams = second ? 2 : 1;
  if (bounce.bytes() < std::min(bytes, streams * kChunkBytes)) {
    fail(what, ": a bounce of ", bounce.bytes(), " B is too small for a copy of ", bytes, " B");
  }
  uint64_t index = 0;
  for (uint64_t at = 0; at < bytes; at += kChunkBytes, ++index) {
    const uint64_t track = index % streams;
    const CUstream on = track ? second->stream.handle() : stream;
    const CUdeviceptr through = bounce.address() + track * kChunkBytes;
    const uint64_t size = std::min(kChunkBytes, bytes - at);
    if (track == 1 && index == 1) second->started.waitOn(on);
    queueOne(on, through, from.address + at, size, what);
    if (second && index == 0) second->started.record(stream);
    queueOne(on, to.address + at, through, size, what);
  }
  if (second) {
    second->done.record(second->stream.handle());
    second->done.waitOn(stream);
  }
}

// A stream's bounce, its side stream, and the event after its last pass.
struct StreamBounce {
  std::mutex mutex;  // held while its hops are queued: two threads may share a stream
  // Made at the stream's first copy past one chunk: streams that only ever copy less hold no
  // stream or events they never use.
  std::unique_ptr<SideStream> second;
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
    SideStream* second = nullptr;
    if (bytes > kChunkBytes) {
      if (!entry->second) entry->second = std::make_unique<SideStream>(streamDevice);
      second = entry->second.get();
    }
    queueBounced(stream, to, from, bytes, entry->lease->bounce(), second, what);
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
  if (!through) through = std::make_unique<BounceLease>(to.device, std::min(bytes, kChunkBytes));
  // One stream: a capturing stream has no id to find its side stream by (cuStreamGetId is
  // refused during capture).
  queueBounced(stream, to, from, bytes, through->bounce(), nullptr, what);
}

void keepWithGraph(CUgraph graph, std::unique_ptr<BounceLease> lease) {
  // Released, not freed, if the graph does not take it: its nodes use the bounce, which must
  // then never go back to the pool.
  BounceLease* kept = lease.release();
  onGraphDestroyed(graph, [kept]() { delete kept; });
}

}  // namespace smfree::engine::cuda
