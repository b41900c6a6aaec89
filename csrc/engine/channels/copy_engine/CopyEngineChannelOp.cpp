// An op's part of CopyEngineChannel: each step goes to the channel, which keeps the op's
// transfers.
#include "engine/channels/copy_engine/CopyEngineChannelOp.h"

#include "engine/channels/copy_engine/CopyEngineChannel.h"

namespace smfree::engine {
namespace {

// The progress thread makes CUDA calls for every op here; an eager send's wait() and a
// collective lane's piece's return at once.
OpTraits traitsOf(const Op& op, const CopyEngineOp& state) {
  return OpTraits{.callsCudaOnProgressThread = true,
                  .returnsAtOnce = state.collective || (op.isSend() && state.eager.has_value())};
}

}  // namespace

CopyEngineChannelOp::CopyEngineChannelOp(CopyEngineChannel& channel, const Op& op,
                                         CopyEngineOp state)
    : ChannelOp(traitsOf(op, state)),
      channel_(channel),
      state_(std::move(state)),
      // An op of a collective lane has no `copied` event: its stream waits for its `done` word.
      fence_{state_.queued, state_.done, state_.collective ? nullptr : state_.copied,
             state_.eagerRecv} {}

bool CopyEngineChannelOp::queued() { return channel_.fenceQueued(fence_); }

void CopyEngineChannelOp::waitOnStream(void* stream, int device) {
  channel_.waitOnStream(stream, device, fence_);
}

ChannelAnnouncement CopyEngineChannelOp::announce(const std::shared_ptr<Op>& send,
                                                  Peer& destination) {
  ChannelAnnouncement announcement{.channelData = channel_.announce(*send)};
  channel_.prepareSend(send, destination);
  return announcement;
}

std::string CopyEngineChannelOp::arm(const std::shared_ptr<Op>& recv, Peer& source,
                                     const std::string& announced) {
  return channel_.armRecv(recv, source, announced);
}

// A recv's clear-to-send leaving starts nothing here: its sender's copy writes the buffer.
void CopyEngineChannelOp::start(const std::shared_ptr<Op>& op, Peer& partner,
                                const std::string& channelData, bool /*promised*/) {
  if (op->isSend()) channel_.startSend(op, partner, channelData);
}

void CopyEngineChannelOp::cancel(Op& op, Cancel why) {
  if (why == Cancel::kPartnerGaveUp) {
    channel_.partnerGaveUp(op);
  } else {
    channel_.cancel(op);
  }
}

void CopyEngineChannelOp::end(Op& op, const Status& status) { channel_.ended(op, status); }

void CopyEngineChannelOp::release(Op& op) { channel_.release(op); }

std::string CopyEngineChannelOp::describe(const Op& op) const {
  return channel_.describeWait(op);
}

bool CopyEngineChannelOp::outlivesWait(const Op& op) const { return channel_.outlivesWait(op); }

}  // namespace smfree::engine
