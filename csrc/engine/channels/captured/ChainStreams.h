#pragma once

#include <cuda.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/cuda/Event.h"
#include "engine/cuda/Stream.h"

namespace smfree::engine {

// The stream that a capture's smfree nodes go on, one per (capture, device): every captured op
// of the process joins it in program order, a send at its post and a recv at its wait(), so in
// each graph smfree's nodes form one chain (CapturedChannel.h says why). A chain joins its
// capture through an event of the caller's stream and rejoins it at the ops' wait(); once the
// capture ends the stream serves the next one. A recv's `ready`, on the caller's stream, joins
// the chain at the chain's next join (joinLater).
class ChainStreams {
 public:
  // Callers' threads: the chain of the capture `captureId` on `device`, after it has waited for
  // what joinLater left it and for `after` (recorded on a stream of that capture: the chain
  // joins it then, if it had not).
  CUstream join(uint64_t captureId, int device, const cuda::Event& after);
  // Callers' threads: the chain of `captureId` on `device` waits for `after` at its next join,
  // if the event is still held then (its op's graph keeps it); nothing is forked now.
  void joinLater(uint64_t captureId, int device, const std::shared_ptr<cuda::Event>& after);

 private:
  struct Chain {
    std::unique_ptr<cuda::Stream> stream;
    uint64_t captureId = 0;
  };

  CUstream chainLocked(uint64_t captureId, int device);  // under mutex_

  std::mutex mutex_;
  std::map<int, std::vector<Chain>> byDevice_;
  // By (capture, device). Events whose graphs are gone are dropped at each call.
  std::map<std::pair<uint64_t, int>, std::vector<std::weak_ptr<cuda::Event>>> later_;
};

}  // namespace smfree::engine
