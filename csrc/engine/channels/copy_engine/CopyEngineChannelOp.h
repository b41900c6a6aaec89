#pragma once

#include <memory>
#include <string>

#include "engine/Channel.h"
#include "engine/channels/copy_engine/CopyEngineOp.h"

namespace smfree::engine {

class CopyEngineChannel;

// What the caller's thread reads of an op (its fence), fixed at the post: the progress thread
// gives the state's own copies back at release().
struct CopyEngineFence {
  cuda::Flag queued;
  cuda::Flag done;
  std::shared_ptr<cuda::Event> copied;  // none for a collective lane's: its stream waits on `done`
  std::shared_ptr<EagerRecv> eagerRecv;
};

// An op's part of CopyEngineChannel (Op::channelOp): its state and its fence. The channel does
// the work.
class CopyEngineChannelOp final : public ChannelOp {
 public:
  // Caller's thread, at the end of CopyEngineChannel::prepare(): `state` is complete.
  CopyEngineChannelOp(CopyEngineChannel& channel, const Op& op, CopyEngineOp state);

  CopyEngineOp& state() { return state_; }

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
  std::string describe(const Op& op) const override;
  bool outlivesWait(const Op& op) const override;

 private:
  CopyEngineChannel& channel_;
  CopyEngineOp state_;
  const CopyEngineFence fence_;
};

inline CopyEngineOp& copyEngineOp(const Op& op) {
  return static_cast<CopyEngineChannelOp&>(*op.channelOp).state();
}

}  // namespace smfree::engine
