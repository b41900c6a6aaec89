#include "engine/channels/captured/ChainStreams.h"

#include <algorithm>
#include <iterator>

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
  const auto later = later_.find({captureId, device});
  if (later != later_.end()) {
    for (const auto& held : later->second) {
      if (const auto event = held.lock()) event->waitOn(chain);
    }
    later_.erase(later);
  }
  after.waitOn(chain);
  return chain;
}

void ChainStreams::joinLater(uint64_t captureId, int device,
                             const std::shared_ptr<cuda::Event>& after) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Captures that ended without another join leave entries: drop those whose graphs are gone.
  for (auto it = later_.begin(); it != later_.end();) {
    auto& events = it->second;
    events.erase(std::remove_if(events.begin(), events.end(),
                                [](const auto& held) { return held.expired(); }),
                 events.end());
    it = events.empty() ? later_.erase(it) : std::next(it);
  }
  later_[{captureId, device}].push_back(after);
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
