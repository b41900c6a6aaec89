#include "engine/cuda/FlagSegment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "engine/Error.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {
namespace {

constexpr size_t kBytes = FlagSegment::kWords * sizeof(uint32_t);
// The words and the tail after them: one mapping per process, of which CUDA registers the words.
constexpr size_t kFileBytes = kBytes + FlagSegment::kTailBytes;

volatile uint32_t* mapWords(int fd, const std::string& what) {
  void* address = mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) {
    fail("cannot map ", what, ": ", std::strerror(errno));
  }
  return static_cast<volatile uint32_t*>(address);
}

void registerHost(volatile uint32_t* words) {
  // Portable: any context may use it; device-mapped: streams can write and wait on it.
  check(driver().cuMemHostRegister(const_cast<uint32_t*>(words), kBytes,
                                   CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
        "cuMemHostRegister of a flag segment");
}

// Atomic, so that a value a GPU writes meanwhile is not overwritten by a smaller one.
void raise(volatile uint32_t* word, uint32_t value) {
  uint32_t* plain = const_cast<uint32_t*>(word);
  uint32_t seen = __atomic_load_n(plain, __ATOMIC_ACQUIRE);
  while (!reached(seen, value) &&
         !__atomic_compare_exchange_n(plain, &seen, value, false, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE)) {
  }
}

}  // namespace

bool reached(uint32_t word, uint32_t value) {
  // The same test as CU_STREAM_WAIT_VALUE_GEQ, so wrap-around agrees with the GPU's.
  return static_cast<int32_t>(word - value) >= 0;
}

FlagSegment::FlagSegment() {
  fd_ = memfd_create("smfree-flags", MFD_CLOEXEC);
  // The tail costs no memory until a page of it is touched.
  if (fd_ < 0 || ftruncate(fd_, kFileBytes) != 0) {
    fail("cannot create the flag segment: ", std::strerror(errno));
  }
  words_ = mapWords(fd_, "the flag segment");
  path_ = concat("/proc/", getpid(), "/fd/", fd_);
  free_.reserve(kWords);
  for (uint32_t i = kWords; i > 0; --i) free_.push_back(i - 1);
  generation_.assign(kWords, 0);
}

FlagSegment::~FlagSegment() {
  if (registered_) {
    driver().cuMemHostUnregister(const_cast<uint32_t*>(words_));
  }
  munmap(const_cast<uint32_t*>(words_), kFileBytes);
  close(fd_);
}

Flag FlagSegment::acquire(uint32_t span) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.empty()) {
    fail("all ", kWords, " flag words are in use: too many CUDA ops in flight");
  }
  const uint32_t index = free_.back();
  free_.pop_back();
  uint32_t first = generation_[index] + 1;
  const uint32_t last = first + (span - 1);
  if (first == 0 || last < first) {
    first = 1;  // no value of a use is 0, the word's value before its first use
  }
  generation_[index] = first + (span - 1);
  return Flag{index, first};
}

void FlagSegment::release(const Flag& flag) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(flag.index);
}

size_t FlagSegment::inUse() {
  std::lock_guard<std::mutex> lock(mutex_);
  return kWords - free_.size();
}

bool FlagSegment::isSet(const Flag& flag) const { return reached(words_[flag.index], flag.value); }

void FlagSegment::set(const Flag& flag) const { raise(words_ + flag.index, flag.value); }

void FlagSegment::store(const Flag& flag, uint32_t value) const {
  __atomic_store_n(const_cast<uint32_t*>(words_ + flag.index), value, __ATOMIC_RELEASE);
}

void* FlagSegment::cudaAddress(uint32_t index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!registered_) {
      registerHost(words_);
      registered_ = true;
    }
  }
  // Unified addressing: the host address of registered memory is valid on the device.
  return const_cast<uint32_t*>(words_ + index);
}

RemoteFlagSegment::RemoteFlagSegment(const std::string& path) {
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    fail("cannot open a peer's flag segment ", path, ": ", std::strerror(errno),
         " (same-host CUDA transfers need access to the peer's /proc/<pid>/fd)");
  }
  words_ = mapWords(fd, path);
  close(fd);
}

RemoteFlagSegment::~RemoteFlagSegment() {
  if (registered_) {
    driver().cuMemHostUnregister(const_cast<uint32_t*>(words_));
  }
  munmap(const_cast<uint32_t*>(words_), kFileBytes);
}

bool RemoteFlagSegment::isSet(const Flag& flag) const {
  return reached(words_[flag.index], flag.value);
}

void RemoteFlagSegment::set(const Flag& flag) const { raise(words_ + flag.index, flag.value); }

void* RemoteFlagSegment::cudaAddress(uint32_t index) {
  // Read without the lock once registered: eager sends ask at every post.
  if (!registered_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!registered_.load(std::memory_order_relaxed)) {
      registerHost(words_);
      registered_.store(true, std::memory_order_release);
    }
  }
  // Unified addressing: the host address of registered memory is valid on the device.
  return const_cast<uint32_t*>(words_ + index);
}

}  // namespace smfree::engine::cuda
