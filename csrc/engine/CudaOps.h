#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

#include "engine/cuda/FlagSegment.h"

namespace smfree::engine {

struct Op;

// Flag words per op, and words kept back for the copy engines' rings (a word per slot: 2 per
// staging ring, 8 per eager ring, one ring of each per sending process and device, so about
// 100 such senders): the flag segment holds
// (FlagSegment::kWords - kStagingFlagWords) / kFlagsPerCudaOp ops.
constexpr size_t kFlagsPerCudaOp = 4;  // a staged recv: ready, queued, progress, copiedIn
constexpr size_t kStagingFlagWords = 1024;

// What the channels' CUDA ops share: this process's flag segment, the bound on CUDA ops in
// flight (SMFREE_MAX_CUDA_OPS), and the words that wait for their stream's write before
// they are reused.
class CudaOps {
 public:
  explicit CudaOps(size_t maxInFlight) : maxInFlight_(maxInFlight) {}
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  cuda::FlagSegment& flags() { return flags_; }

  // Caller's thread, before it enqueues anything on its stream: blocks until fewer than the
  // bound are in flight (words in use, tensors held), then counts one more.
  void admit(std::chrono::milliseconds timeout);
  // Any thread: an admitted op has released what it held.
  void retire();
  // Caller's thread: queues the write of `flag` on the op's stream, in its device's context.
  void writeFromStream(const Op& op, const cuda::Flag& flag);
  // Progress thread: gives the word back once its stream has written it (it may still).
  void releaseOnceWritten(const cuda::Flag& flag);
  // Progress thread: gives back the words whose streams have since written them.
  void recycle();

 private:
  cuda::FlagSegment flags_;
  const size_t maxInFlight_;
  std::mutex inFlightMutex_;
  std::condition_variable inFlightFreed_;
  size_t inFlight_ = 0;
  std::vector<cuda::Flag> unwritten_;  // progress thread only
};

}  // namespace smfree::engine
