// An op's part of UcxChannel, on the progress thread: each step goes to the channel, which
// keeps the op's movement (its UCX requests and pieces) by op id.
#include "engine/channels/ucx/UcxChannelOp.h"

#include "engine/channels/ucx/UcxChannel.h"

namespace smfree::engine {

ChannelAnnouncement UcxChannelOp::announce(const std::shared_ptr<Op>& send, Peer& destination) {
  return channel_.announce(send, destination);
}

std::string UcxChannelOp::arm(const std::shared_ptr<Op>& recv, Peer& source,
                              const std::string& /*announced*/) {
  return channel_.armRecv(recv, source);
}

void UcxChannelOp::start(const std::shared_ptr<Op>& op, Peer& partner,
                         const std::string& channelData, bool promised) {
  if (op->isSend()) {
    channel_.startSend(op, partner, channelData);
  } else {
    channel_.cleared(op, promised);
  }
}

// Either way its requests are cancelled: a partner that gave up sends nothing more.
void UcxChannelOp::cancel(Op& op, Cancel /*why*/) { channel_.cancel(op); }

void UcxChannelOp::end(Op& op, const Status& /*status*/) { channel_.ended(op); }

void UcxChannelOp::release(Op& op) { channel_.release(op); }

bool UcxChannelOp::outlivesWait(const Op& op) const { return channel_.outlivesWait(op); }

}  // namespace smfree::engine
