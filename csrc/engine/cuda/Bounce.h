#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>

#include "engine/cuda/DeviceMemory.h"
#include "engine/cuda/Event.h"
#include "engine/cuda/PinnedMemory.h"

namespace smfree::engine::cuda {

// Memory that a copy within one GPU passes through, so that each of its two hops crosses a
// device boundary and runs on a copy engine: the CUDA 13.0 driver runs a copy whose source and
// destination are on one GPU as a kernel of its own, on SMs (docs/design.md, "Zero SMs"). It
// lies on a peer GPU that the GPU reaches over NVLink (bounceDevice(); SMFREE_LOCAL_COPIES
// peer_gpu), or in pinned host memory (host, or where no peer GPU is reachable).
class Bounce {
 public:
  // For copies within `device`, `bytes` at a time. Throws Error when the memory cannot be had.
  Bounce(int device, uint64_t bytes);

  CUdeviceptr address() const;
  uint64_t bytes() const { return bytes_; }
  int device() const { return device_; }  // whose copies it serves

 private:
  int device_;
  uint64_t bytes_;
  std::unique_ptr<DeviceMemory> onPeer_;
  std::unique_ptr<PinnedMemory> onHost_;
};

// A copy passes through its bounce in chunks of up to this size (measured on H200 through a peer
// GPU: each chunk's hop costs about 8 µs beyond its bytes, 16 MiB about 43 µs).
constexpr uint64_t kChunkBytes = 16ull << 20;
// The largest bounce: a longer copy's two streams of chunks take a half each (cuda/Copies.h).
constexpr uint64_t kMaxBounceBytes = 2 * kChunkBytes;

// The size of bounce a copy of `bytes` takes: a power of two from 1 MiB to kChunkBytes, or
// kMaxBounceBytes past one chunk.
uint64_t bounceBytesFor(uint64_t bytes);

// A bounce for copies within `device`, taken from the process's pool and given back when the
// lease ends: bounces are never freed while the process runs, since cuMemFree waits for the
// device to go idle, which a stream parked on a peer's flag may put off for good.
class BounceLease {
 public:
  // Of bounceBytesFor(bytes); throws Error when none can be had.
  BounceLease(int device, uint64_t bytes);
  ~BounceLease();  // gives it back; no CUDA call, so it may end in a CUDA driver callback
  BounceLease(const BounceLease&) = delete;
  BounceLease& operator=(const BounceLease&) = delete;

  const Bounce& bounce() const { return *bounce_; }
  // The bounce goes back only once `event`'s last record has run (its last pass).
  void usedUntil(std::shared_ptr<Event> event) { lastUse_ = std::move(event); }

 private:
  std::shared_ptr<Bounce> bounce_;
  std::shared_ptr<Event> lastUse_;
};

// The GPU whose memory bounces `device`'s copies within itself: the next one in device order
// that it reaches as a peer (access enabled once); -1 where there is none (pinned host memory).
// Logged once per device.
int bounceDevice(int device);

}  // namespace smfree::engine::cuda
