#pragma once

#include <memory>
#include <vector>

#include "engine/Channel.h"
#include "engine/CudaOps.h"
#include "engine/channels/loopback/LoopbackPairing.h"

namespace smfree::engine {

// The data channel of the ops to the rank itself: the engine's face of LoopbackPairing, which
// pairs them at their post and moves their bytes. Its ops are within the process
// (OpTraits::withinProcess): no peer, no endpoint, no message. It is driven from the progress
// loop, which tells each op's end once the op has started.
class LoopbackChannel final : public Channel {
 public:
  LoopbackChannel(CudaOps& cudaOps, Done onDone)
      : Channel({Capability::kProgress}), pairing_(cudaOps), onDone_(std::move(onDone)) {}

  // Caller's thread: every op to the rank itself, CPU ones too (whose fence is not used).
  std::shared_ptr<ChannelOp> prepare(Op& op, const PostOptions& options) override;

  // ---------------------------------------------------------- progress thread
  void peerFailed(Peer& peer) override {}  // it has no peer
  void flush(Clock::time_point deadline) override { pairing_.flush(deadline); }
  void stop() override {}  // no thread of its own
  void report(ChannelReport& report) const override {}  // holds no peer's memory
  // Its flag words are read in memory, without a CUDA call.
  Progress progress() override;
  bool busy() const override { return pairing_.busy(); }

 private:
  LoopbackPairing pairing_;
  const Done onDone_;
};

}  // namespace smfree::engine
