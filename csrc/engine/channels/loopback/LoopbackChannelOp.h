#pragma once

#include <memory>
#include <string>

#include "engine/Channel.h"
#include "engine/channels/loopback/LoopbackOp.h"

namespace smfree::engine {

class LoopbackPairing;

// An op to the rank itself as the engine holds it (Op::channelOp, and its caller's fence): its
// LoopbackOp, paired at the post. It meets no peer, so nothing announces, arms or starts it;
// its end is told by LoopbackChannel::progress().
class LoopbackChannelOp final : public ChannelOp {
 public:
  LoopbackChannelOp(LoopbackPairing& pairing, std::shared_ptr<LoopbackOp> half)
      : ChannelOp(withinProcess()), pairing_(pairing), half_(std::move(half)) {}

  // Caller's thread.
  bool queued() override;
  void waitOnStream(void* stream, int device) override;

  // Progress thread. An op within the process never reaches a peer's protocol.
  ChannelAnnouncement announce(const std::shared_ptr<Op>& send, Peer& destination) override;
  std::string arm(const std::shared_ptr<Op>& recv, Peer& source,
                  const std::string& announced) override;
  void start(const std::shared_ptr<Op>& op, Peer& partner, const std::string& channelData,
             bool promised) override;
  // Its bytes are queued at the post, never later (it is never moving): nothing to stop.
  void cancel(Op& op, Cancel why) override {}
  void end(Op& op, const Status& status) override;
  // The pair keeps both buffers while an uncaptured copy runs (LoopbackPair).
  void release(Op& op) override {}
  std::string describe(const Op& op) const override;
  bool outlivesWait(const Op& op) const override { return false; }

 private:
  static OpTraits withinProcess() {
    OpTraits traits;
    traits.withinProcess = true;
    return traits;
  }

  LoopbackPairing& pairing_;
  const std::shared_ptr<LoopbackOp> half_;
};

}  // namespace smfree::engine
