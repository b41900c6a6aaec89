#pragma once

#include <memory>
#include <string>

#include "engine/Channel.h"
#include "engine/channels/captured/CapturedOp.h"

namespace smfree::engine {

class CapturedChannel;

// A captured op's part of CapturedChannel (Op::channelOp, and its caller's fence). Everything
// moves at capture: a send ends once its recv matched it, a recv once its clear-to-send left;
// the rest is the graph's.
class CapturedChannelOp final : public ChannelOp {
 public:
  CapturedChannelOp(CapturedChannel& channel, std::shared_ptr<CapturedOp> op);

  bool queued() override;
  void waitOnStream(void* stream, int device) override;
  ChannelAnnouncement announce(const std::shared_ptr<Op>& send, Peer& destination) override;
  std::string arm(const std::shared_ptr<Op>& recv, Peer& source,
                  const std::string& announced) override;
  void start(const std::shared_ptr<Op>& op, Peer& partner, const std::string& channelData,
             bool promised) override;
  void cancel(Op& op, Cancel why) override {}  // nothing moves at capture: it ends as it fails
  void end(Op& op, const Status& status) override;
  // The graph keeps what its nodes use, to the end of its life (CapturedChannel's graveyard).
  void release(Op& op) override {}
  std::string describe(const Op& op) const override;
  bool outlivesWait(const Op& op) const override { return false; }

  CapturedOp& op() { return *op_; }

 private:
  CapturedChannel& channel_;
  const std::shared_ptr<CapturedOp> op_;
};

inline CapturedOp& capturedOf(const Op& op) {
  return static_cast<CapturedChannelOp&>(*op.channelOp).op();
}

}  // namespace smfree::engine
