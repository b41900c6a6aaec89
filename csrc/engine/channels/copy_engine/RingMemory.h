#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace smfree::engine {

// The GPU memory this process gives its senders' rings (staging and eager, StagingRing.h),
// bounded per process by SMFREE_RING_MEMORY_BYTES, all devices together. A ring that does
// not fit is not made: its sends go by rendezvous, which needs no memory of the receiver's.
class RingMemory {
 public:
  // Bytes taken, given back when destroyed.
  class Share {
   public:
    Share(RingMemory& memory, int device, uint64_t bytes);
    ~Share();
    Share(const Share&) = delete;
    Share& operator=(const Share&) = delete;

   private:
    RingMemory& memory_;
    int device_;
    uint64_t bytes_;
  };

  explicit RingMemory(uint64_t bound) : bound_(bound) {}

  // `bytes` on `device` for `what` (a ring, named for the log); throws Error naming the bound
  // where they would pass it.
  std::unique_ptr<Share> take(int device, uint64_t bytes, const std::string& what);
  uint64_t taken() const;
  uint64_t bound() const { return bound_; }
  // "cuda:0 72 MiB, cuda:1 16 MiB of 1024 MiB (SMFREE_RING_MEMORY_BYTES)".
  std::string describe() const;
  // Logs a ring not made: the process's first as a warning, later ones at info.
  static void refused(const std::string& message);

 private:
  void give(int device, uint64_t bytes);

  const uint64_t bound_;
  mutable std::mutex mutex_;
  std::map<int, uint64_t> byDevice_;
  uint64_t taken_ = 0;
};

}  // namespace smfree::engine
