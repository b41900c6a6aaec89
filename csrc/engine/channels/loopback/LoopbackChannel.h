#pragma once

#include <memory>
#include <string>

#include "engine/Channel.h"
#include "engine/CudaOps.h"
#include "engine/channels/loopback/LoopbackPairing.h"

namespace smfree::engine {

// The data channel of the ops to the rank itself: the engine's face of LoopbackPairing, which
// pairs them at their post and moves their bytes.
class LoopbackChannel final : public Channel {
 public:
  LoopbackChannel(CudaOps& cudaOps, Done onDone) : pairing_(cudaOps), onDone_(std::move(onDone)) {}

  // ---------------------------------------------------------- caller's thread
  // Every op to the rank itself, CPU ones too (whose fence is not used).
  CudaFence prepare(Op& op, const PostOptions& options) override;
  bool fenceQueued(const CudaFence& fence) override;
  void waitOnStream(void* stream, int device, const CudaFence& fence) override;

  // ---------------------------------------------------------- progress thread
  void flush(Clock::time_point deadline) override { pairing_.flush(deadline); }
  // Its flag words are read in memory, without a CUDA call.
  bool callsCudaOnProgressThread(const Op& op) const override { return false; }
  // Its ops meet no peer: never announced, armed or cleared.
  std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source,
                      const std::string& announced) override;
  void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                 const std::string& channelData) override;
  void start(const std::shared_ptr<Op>& op) override;
  // Its ops never move bytes past their post: nothing to stop.
  void cancel(Op& op) override {}
  void ended(Op& op, const Status& status) override { pairing_.ended(op); }
  bool progress() override;
  bool busy() const override { return pairing_.busy(); }

 private:
  // Outside the pairing's lock: ending an op comes back to ended().
  void report(const std::vector<LoopbackPairing::Report>& reports);

  LoopbackPairing pairing_;
  const Done onDone_;
};

}  // namespace smfree::engine
