#pragma once

#include <cstdint>

namespace smfree::engine::cuda {

// Page-locked host memory from the CUDA driver, portable (any device's copy engines reach it
// at full speed), freed when destroyed.
class PinnedMemory {
 public:
  // `device`: whose context allocates it.
  PinnedMemory(int device, uint64_t bytes);
  ~PinnedMemory();
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;

  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  int device_;
  uint64_t bytes_;
  void* data_ = nullptr;
};

}  // namespace smfree::engine::cuda
