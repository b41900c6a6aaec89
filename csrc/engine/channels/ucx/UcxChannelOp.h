#pragma once

#include <memory>
#include <optional>
#include <string>

#include "engine/Channel.h"
#include "engine/channels/ucx/UcxCudaOp.h"

namespace smfree::engine {

class UcxChannel;

// An op's part of UcxChannel: its CUDA state (none for a CPU tensor: those ops share one
// UcxChannelOp), and its fence, fixed at the post so that the caller's thread reads only what
// the progress thread never changes. The channel does the work.
class UcxChannelOp final : public UcxCudaOpHolder {
 public:
  // A CPU tensor's.
  explicit UcxChannelOp(UcxChannel& channel)
      : UcxCudaOpHolder({}, std::nullopt), channel_(channel) {}
  UcxChannelOp(UcxChannel& channel, UcxCudaOp cuda, OpTraits traits);

  bool queued() override;
  void waitOnStream(void* stream, int device) override;
  ChannelAnnouncement announce(const std::shared_ptr<Op>& send, Peer& destination) override;
  std::string arm(const std::shared_ptr<Op>& recv, Peer& source,
                  const std::string& announced) override;
  void start(const std::shared_ptr<Op>& op, Peer& partner, const std::string& channelData,
             bool promised) override;
  void cancel(Op& op, Cancel why) override;
  void end(Op& op, const Status& status) override;
  void release(Op& op) override;
  std::string describe(const Op& op) const override { return {}; }
  bool outlivesWait(const Op& op) const override;

 private:
  UcxChannel& channel_;
  // The fence's: copies of the state's, which release() gives back.
  cuda::Flag queued_;
  std::shared_ptr<cuda::Event> copied_;
  std::shared_ptr<CallerRelay> relayedRecv_;  // its wait() queues its copies in
};

}  // namespace smfree::engine
