#include "engine/cuda/Bounce.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"
#include "engine/cuda/LocalCopies.h"

namespace smfree::engine::cuda {
namespace {

int findBounceDevice(int device) {
  int count = 0;
  check(driver().cuDeviceGetCount(&count), "cuDeviceGetCount");
  for (int step = 1; step < count; ++step) {
    const int peer = (device + step) % count;
    if (enablePeerAccess(device, peer)) {
      log(LogLevel::kInfo, "copies within cuda:", device, " pass through cuda:", peer,
          " (two NVLink copies on copy engines; the driver runs a copy within one GPU on SMs)");
      return peer;
    }
  }
  log(LogLevel::kWarn, "copies within cuda:", device, " pass through pinned host memory (two "
      "PCIe copies on copy engines): no other GPU is reachable from it, and the driver runs a "
      "copy within one GPU on SMs. Ranks sharing this GPU: SMFREE_EAGER_BYTES=0 halves the "
      "copies of each message; SMFREE_LOCAL_COPIES=driver under CUDA MPS is faster but takes SMs");
  return -1;
}

// Bounces given back, per device served, each with the event after its last pass.
class BouncePool {
 public:
  std::shared_ptr<Bounce> take(int device, uint64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& idle = idle_[{device, bytes}];
      for (auto it = idle.begin(); it != idle.end(); ++it) {
        if (!it->second || it->second->reached()) {
          auto bounce = std::move(it->first);
          idle.erase(it);
          return bounce;
        }
      }
    }
    return std::make_shared<Bounce>(device, bytes);
  }

  void giveBack(std::shared_ptr<Bounce> bounce, std::shared_ptr<Event> lastUse) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[{bounce->device(), bounce->bytes()}];
    idle.emplace_back(std::move(bounce), std::move(lastUse));
  }

 private:
  std::mutex mutex_;
  // By (device served, bytes).
  std::map<std::pair<int, uint64_t>,
           std::vector<std::pair<std::shared_ptr<Bounce>, std::shared_ptr<Event>>>>
      idle_;
};

BouncePool& pool() {
  // Never destroyed: at process exit the driver may be gone before static destructors run.
  static auto* instance = new BouncePool();
  return *instance;
}

}  // namespace

uint64_t bounceBytesFor(uint64_t bytes) {
  if (bytes > kChunkBytes) return kMaxBounceBytes;
  uint64_t size = 1ull << 20;
  while (size < bytes) size *= 2;
  return size;
}

BounceLease::BounceLease(int device, uint64_t bytes)
    : bounce_(pool().take(device, bounceBytesFor(bytes))) {}

BounceLease::~BounceLease() { pool().giveBack(std::move(bounce_), std::move(lastUse_)); }

int bounceDevice(int device) {
  static std::mutex mutex;
  static std::map<int, int> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(device);
  if (it != known.end()) return it->second;
  const int peer = findBounceDevice(device);
  known.emplace(device, peer);
  return peer;
}

Bounce::Bounce(int device, uint64_t bytes) : device_(device), bytes_(bytes) {
  const int peer = localCopies() == LocalCopies::kPeerGpu ? bounceDevice(device) : -1;
  if (peer >= 0) {
    onPeer_ = std::make_unique<DeviceMemory>(peer, bytes);
  } else {
    onHost_ = std::make_unique<PinnedMemory>(device, bytes);
  }
}

CUdeviceptr Bounce::address() const {
  // Pinned host memory has one address in every context (unified addressing).
  return onPeer_ ? onPeer_->address() : reinterpret_cast<CUdeviceptr>(onHost_->data());
}

}  // namespace smfree::engine::cuda
