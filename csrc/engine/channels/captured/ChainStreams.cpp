#include "engine/channels/captured/ChainStreams.h"

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/Capture.h"

namespace smfree::engine {
namespace {

// Whether the stream takes part in no capture now (an invalidated one counts as taking part:
// its stream is left alone until that capture ends).
bool idle(CUstream stream) {
  try {
    return !cuda::captureOf(stream);
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

CUstream ChainStreams::join(uint64_t captureId, int device, const cuda::Event& after) {
  // Under the lock until the chain has joined: another capture then sees it taken.
  std::lock_guard<std::mutex> lock(mutex_);
  const CUstream chain = chainLocked(captureId, device);
  after.waitOn(chain);
  return chain;
}

CUstream ChainStreams::chainLocked(uint64_t captureId, int device) {
  std::vector<Chain>& chains = byDevice_[device];
  for (const Chain& chain : chains) {
    if (chain.captureId == captureId) return chain.stream->handle();
  }
  for (Chain& chain : chains) {
    if (idle(chain.stream->handle())) {
      chain.captureId = captureId;
      return chain.stream->handle();
    }
  }
  chains.push_back(Chain{
      std::make_unique<cuda::Stream>(device, cuda::Stream::OnDestroy::kRelease), captureId});
  log(LogLevel::kInfo, "graph chain stream ", chains.size(), " on cuda:", device);
  return chains.back().stream->handle();
}

}  // namespace smfree::engine
