#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "engine/Op.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/PinnedMemory.h"
#include "engine/cuda/Stream.h"

namespace smfree::engine {

// Copies between CUDA buffers and page-locked host memory on the copy engines, for UCX
// paths that move host memory faster than CUDA memory. Over TCP, UCX copies CUDA memory in
// pieces of one TCP segment, each copy synchronous ("fragmented copy-in copy-out"): a 16 MiB
// exchange between two H200s took 18 ms that way and 8 ms from pinned host memory.
// Progress thread only.
class HostStaging {
 public:
  HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Host memory of at least `bytes`, allocated in `device`'s context when the cache has none
  // of its size class; it goes back to the cache when its last holder drops it.
  std::shared_ptr<cuda::PinnedMemory> take(int device, uint64_t bytes);
  // Queue the copy of `bytes` at `offset` of the buffer to the same offset of the host memory
  // (or back) on the device's stream for that direction; the returned event is recorded
  // after it.
  std::shared_ptr<cuda::Event> copyToHost(const Buffer& from, const cuda::PinnedMemory& to,
                                          uint64_t offset, uint64_t bytes);
  std::shared_ptr<cuda::Event> copyToDevice(const cuda::PinnedMemory& from, const Buffer& to,
                                            uint64_t offset, uint64_t bytes);
  // Copies queued from now on for `device`, in that direction, wait for `event`'s last record.
  void copyToHostAfter(int device, const cuda::Event& event);
  void copyToDeviceAfter(int device, const cuda::Event& event);
  // Records `event` after the copies queued so far for `device` in that direction.
  void recordAfterCopiesToHost(int device, cuda::Event& event);
  void recordAfterCopiesToDevice(int device, cuda::Event& event);
  uint64_t cachedBytes() const;

 private:
  struct Cache;
  using Streams = std::map<int, std::unique_ptr<cuda::Stream>>;
  cuda::Stream& streamOf(Streams& streams, int device, const char* direction);
  // Queues `bytes` from `from` to `to` on the device's stream in `streams`.
  std::shared_ptr<cuda::Event> copy(Streams& streams, int device, const char* direction,
                                    const void* to, const void* from, uint64_t bytes);

  std::shared_ptr<Cache> cache_;
  // After cache_, so they are destroyed first: a stream waits for its copies when it goes.
  Streams toHost_;
  Streams toDevice_;
};

}  // namespace smfree::engine
