#include "engine/channels/loopback/LoopbackChannel.h"

#include "engine/channels/loopback/LoopbackChannelOp.h"

namespace smfree::engine {

std::shared_ptr<ChannelOp> LoopbackChannel::prepare(Op& op, const PostOptions& options) {
  return std::make_shared<LoopbackChannelOp>(pairing_, pairing_.post(op, options.timeout));
}

Progress LoopbackChannel::progress() {
  // Told outside the pairing's lock: ending an op comes back to LoopbackChannelOp::end().
  const std::vector<LoopbackPairing::Report> reports = pairing_.progress();
  for (const LoopbackPairing::Report& done : reports) onDone_(done.op, done.status);
  return Progress{!reports.empty()};
}

}  // namespace smfree::engine
