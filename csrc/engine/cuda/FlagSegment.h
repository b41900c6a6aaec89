#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace smfree::engine::cuda {

// One 32-bit signal word in a flag segment, and the value that means "set" for its current
// use. Values only grow per word, so a wait for an old value never blocks on a newer use.
struct Flag {
  uint32_t index = 0;
  uint32_t value = 0;
  // The same word at a later value of this use (see acquire()'s span).
  Flag plus(uint32_t step) const { return Flag{index, value + step}; }
};

// Shared host memory holding this process's signal words. CUDA streams (ours and the
// peers') write and wait on them with stream memory operations; progress threads read them.
// Peers map it through /proc/<pid>/fd/<fd>, so it disappears with the process.
class FlagSegment {
 public:
  static constexpr uint32_t kWords = 16384;
  // Past its words the file holds a tail that same-host peers share with CPU atomics only
  // (never registered with CUDA): the copy engines' collective lanes keep their records there.
  static constexpr size_t kTailBytes = size_t{256} << 20;

  FlagSegment();
  ~FlagSegment();
  FlagSegment(const FlagSegment&) = delete;
  FlagSegment& operator=(const FlagSegment&) = delete;

  // Where peers open it: "/proc/<pid>/fd/<fd>".
  const std::string& path() const { return path_; }

  // Thread-safe. Throws when every word is in use. The use owns `span` values from the one
  // returned: a word can then say which of several things happened.
  Flag acquire(uint32_t span = 1);
  void release(const Flag& flag);

  size_t inUse();
  bool isSet(const Flag& flag) const;
  uint32_t wordOf(const Flag& flag) const { return words_[flag.index]; }
  // Raises the word to the flag's value unless it is there already: a GPU's later value is
  // never lowered. For failure: releases every stream wait on the flag.
  void set(const Flag& flag) const;
  // The word as CUDA streams address it; registers the segment with CUDA on first use.
  void* cudaAddress(uint32_t index);
  // Stores `value` in the word, whatever it held: for a word its use sets and resets (the
  // handshakes of captured graphs), not one whose values grow.
  void store(const Flag& flag, uint32_t value) const;
  // The word itself, for a thread that watches it.
  volatile uint32_t* word(const Flag& flag) const { return words_ + flag.index; }
  // The shared tail (kTailBytes).
  char* tail() const {
    return const_cast<char*>(reinterpret_cast<volatile char*>(words_ + kWords));
  }

 private:
  int fd_ = -1;
  std::string path_;
  volatile uint32_t* words_ = nullptr;
  std::mutex mutex_;
  std::vector<uint32_t> free_;
  std::vector<uint32_t> generation_;
  bool registered_ = false;
};

// A word of a segment, given back when destroyed.
class OwnedFlag {
 public:
  OwnedFlag(FlagSegment& segment, uint32_t span = 1)
      : segment_(segment), flag_(segment.acquire(span)) {}
  ~OwnedFlag() { segment_.release(flag_); }
  OwnedFlag(const OwnedFlag&) = delete;
  OwnedFlag& operator=(const OwnedFlag&) = delete;

  const Flag& get() const { return flag_; }

 private:
  FlagSegment& segment_;
  Flag flag_;
};

// A peer's flag segment, mapped into this process.
class RemoteFlagSegment {
 public:
  explicit RemoteFlagSegment(const std::string& path);
  ~RemoteFlagSegment();
  RemoteFlagSegment(const RemoteFlagSegment&) = delete;
  RemoteFlagSegment& operator=(const RemoteFlagSegment&) = delete;

  bool isSet(const Flag& flag) const;
  uint32_t wordOf(const Flag& flag) const { return words_[flag.index]; }
  void set(const Flag& flag) const;
  // Registers the mapping with CUDA on first use (thread-safe).
  void* cudaAddress(uint32_t index);
  // The word itself, for a compare-and-swap shared with its owner.
  volatile uint32_t* word(const Flag& flag) const { return words_ + flag.index; }
  // The owner's shared tail (FlagSegment::kTailBytes).
  char* tail() const {
    return const_cast<char*>(reinterpret_cast<volatile char*>(words_ + FlagSegment::kWords));
  }

 private:
  volatile uint32_t* words_ = nullptr;
  std::mutex mutex_;  // held while registering
  std::atomic<bool> registered_{false};
};

bool reached(uint32_t word, uint32_t value);

}  // namespace smfree::engine::cuda
