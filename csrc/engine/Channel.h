#pragma once

#include <functional>
#include <memory>
#include <string>

#include "engine/Op.h"
#include "engine/Status.h"

namespace smfree::engine {

struct Peer;

// A data channel moves the bytes of a matched send/recv pair; the control plane has already
// checked that both sides agree. All calls happen on the progress thread.
class Channel {
 public:
  using Done = std::function<void(const std::shared_ptr<Op>&, const Status&)>;

  virtual ~Channel() = default;
  // Sender, when the send is posted (before its receiver has matched it): start what needs
  // no receiver.
  virtual void prepareSend(const std::shared_ptr<Op>& send, Peer& destination) {}
  // Receiver: get ready for the bytes; returns what the sender's side needs to deliver them.
  virtual std::string armRecv(const std::shared_ptr<Op>& recv, Peer& source) = 0;
  // Sender: deliver the bytes, given what armRecv returned on the receiver.
  virtual void startSend(const std::shared_ptr<Op>& send, Peer& destination,
                         const std::string& channelData) = 0;
  // The op has failed: stop its transfer where possible. Done still follows once the channel
  // no longer touches the buffer.
  virtual void cancel(Op& op) = 0;
  // The partner told us it will never move this op's bytes.
  virtual void partnerGaveUp(Op& op) { cancel(op); }
  // Channels that watch memory rather than wait for events are driven from the progress loop.
  virtual bool progress() { return false; }
  virtual bool busy() const { return false; }
  // The peer is gone: nothing it was going to do for this channel will happen.
  virtual void peerFailed(Peer& peer) {}
};

}  // namespace smfree::engine
