#include "engine/Op.h"

#include "engine/Error.h"
#include "engine/GroupConfig.h"

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

}  // namespace smfree::engine
