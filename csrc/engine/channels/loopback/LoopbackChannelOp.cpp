#include "engine/channels/loopback/LoopbackChannelOp.h"

#include "engine/Error.h"
#include "engine/channels/loopback/LoopbackPairing.h"

namespace smfree::engine {
namespace {

[[noreturn]] void notForPeers(const Op& op) {
  fail("internal error: ", op.describe(), ", an op to the rank itself, was handed to a peer's "
       "protocol");
}

}  // namespace

bool LoopbackChannelOp::queued() { return half_->queued.load(std::memory_order_acquire); }

void LoopbackChannelOp::waitOnStream(void* stream, int) {
  // None where nothing was copied (no bytes, or the op failed).
  if (half_->copied) half_->copied->waitOn(static_cast<CUstream>(stream));
}

ChannelAnnouncement LoopbackChannelOp::announce(const std::shared_ptr<Op>& send, Peer&) {
  notForPeers(*send);
}

std::string LoopbackChannelOp::arm(const std::shared_ptr<Op>& recv, Peer&, const std::string&) {
  notForPeers(*recv);
}

void LoopbackChannelOp::start(const std::shared_ptr<Op>& op, Peer&, const std::string&, bool) {
  notForPeers(*op);
}

void LoopbackChannelOp::end(Op& op, const Status&) { pairing_.ended(op); }

std::string LoopbackChannelOp::describe(const Op& op) const {
  return pairing_.describe(op, *half_);
}

}  // namespace smfree::engine
