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
// capture ends the stream serves the next one.
class ChainStreams {
 public:
  // Callers' threads: the chain of the capture `captureId` on `device`, after it has waited for
  // `after` (recorded on a stream of that capture: the chain joins it then, if it had not).
  CUstream join(uint64_t captureId, int device, const cuda::Event& after);

 private:
  struct Chain {
    std::unique_ptr<cuda::Stream> stream;
    uint64_t captureId = 0;
  };

  CUstream chainLocked(uint64_t captureId, int device);  // under mutex_

  std::mutex mutex_;
  std::map<int, std::vector<Chain>> byDevice_;
};

}  // namespace smfree::engine
