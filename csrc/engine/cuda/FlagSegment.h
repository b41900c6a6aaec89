#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "engine/PeerValue.h"

namespace smfree::engine::cuda {

// One 32-bit signal word in a flag segment, and the value that means "set" for its current
// use. Values only grow per word, so a wait for an old value never blocks on a newer use.
struct Flag {
  uint32_t index = 0;
  uint32_t value = 0;
  // The same word at a later value of this use (see acquire()'s span).
  Flag plus(uint32_t step) const { return Flag{index, value + step}; }
};

// What a process publishes for same-host peers to take its flag segment: the fd it holds the
// segment at, and the segment's memfd name, unique to the segment, by which a taker tells it
// from any other file.
struct FlagSegmentRef {
  std::string name;
  int fd = -1;
};

// Shared host memory holding this process's signal words. CUDA streams (ours and the
// peers') write and wait on them with stream memory operations; progress threads read them.
// A memfd sealed against shrink and grow once sized: no process can cut the mapping short
// under its owner or its peers (a shrunk file kills whoever touches its lost pages with
// SIGBUS). Peers take it with pidfd_getfd, so it disappears with the processes holding it.
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

  // What peers take it by.
  const FlagSegmentRef& ref() const { return ref_; }

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
  FlagSegmentRef ref_;
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
  // Takes the segment its owner published through a pidfd of the owner (pidfd_getfd), never
  // through a path: neither a reused pid nor a changed store can redirect it to another file.
  // Checks that what it took is that memfd, sealed, of the segment's size, before mapping it.
  // `owner` names the owner in errors ("pid 123 on host node7").
  RemoteFlagSegment(int ownerPidfd, const FlagSegmentRef& published, const std::string& owner);
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

namespace smfree::engine {

// A word of a flag segment (this process's or a peer's): its index within the segment.
inline void checkFlag(const char* message, const char* field, const cuda::Flag& flag) {
  checkBelow(message, field, flag.index, cuda::FlagSegment::kWords);
}

}  // namespace smfree::engine
