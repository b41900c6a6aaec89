#include "engine/channels/loopback/LoopbackChannel.h"

#include "engine/Error.h"

namespace smfree::engine {

CudaFence LoopbackChannel::prepare(Op& op, const PostOptions&) {
  std::shared_ptr<LoopbackOp> half = pairing_.post(op);
  return CudaFence{.channel = ChannelKind::kLoopback,
                   .loopback = half,
                   .insideCapture = half->capture.has_value()};
}

bool LoopbackChannel::fenceQueued(const CudaFence& fence) {
  return fence.loopback->queued.load(std::memory_order_acquire);
}

void LoopbackChannel::waitOnStream(void* stream, int, const CudaFence& fence) {
  // None where nothing was copied (no bytes, or the op failed).
  if (fence.loopback->copied) fence.loopback->copied->waitOn(static_cast<CUstream>(stream));
}

std::string LoopbackChannel::armRecv(const std::shared_ptr<Op>& recv, Peer&, const std::string&) {
  fail(recv->describe(), ": an op to the rank itself was handed to a peer's protocol");
}

void LoopbackChannel::startSend(const std::shared_ptr<Op>& send, Peer&, const std::string&) {
  fail(send->describe(), ": an op to the rank itself was handed to a peer's protocol");
}

void LoopbackChannel::start(const std::shared_ptr<Op>& op) { report(pairing_.start(*op)); }

bool LoopbackChannel::progress() {
  const std::vector<LoopbackPairing::Report> reports = pairing_.progress();
  report(reports);
  return !reports.empty();
}

void LoopbackChannel::report(const std::vector<LoopbackPairing::Report>& reports) {
  for (const LoopbackPairing::Report& done : reports) onDone_(done.op, done.status);
}

}  // namespace smfree::engine
