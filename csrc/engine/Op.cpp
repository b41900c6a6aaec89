#include "engine/Op.h"

#include "engine/Error.h"
#include "engine/GroupState.h"

namespace smfree::engine {

std::string Op::describe() const {
  const GroupConfig& group = *config;
  const std::string partnerText =
      isSend() ? concat("to rank ", request.peer)
               : (request.peer == kAnySource ? std::string("from any rank")
                                             : concat("from rank ", request.peer));
  return concat(channel == ChannelKind::kCaptured ? "captured " : "", isSend() ? "send" : "recv",
                " on rank ", group.rank, " ", partnerText,
                " (group '", group.name, "', ",
                isCollective() ? std::string("a collective") : concat("tag ", request.tag), ", ",
                request.desc.describe(), ")");
}

uint64_t groupIdOf(const std::string& name) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) {
    hash = (hash ^ c) * 1099511628211ull;
  }
  return hash;
}

}  // namespace smfree::engine
