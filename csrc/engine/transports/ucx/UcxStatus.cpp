#include "engine/transports/ucx/UcxStatus.h"

#include "engine/Error.h"

namespace smfree::engine {

std::string ucxStatusText(ucs_status_t status) { return ucs_status_string(status); }

std::string ucxPeerErrorText(ucs_status_t status) {
  const std::string said = concat("UCX reported '", ucxStatusText(status), "'");
  switch (status) {
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_TIMED_OUT:
      // UCX's keepalive says so too, also where the TCP user timeout is missing (UCX 1.13),
      // and for a peer whose process exited.
      return concat(said, " on the connection to it: it went unanswered (UCX's keepalive every "
                    "SMFREE_PEER_CHECK_MS, or bytes unacknowledged past SMFREE_LINK_TIMEOUT_MS): "
                    "its process or its host went down, or the link to it did");
    case UCS_ERR_CONNECTION_RESET:
      // Also what UCX reports when the link timeout (SMFREE_LINK_TIMEOUT_MS) ends a connection.
      return concat(said, ": its process or its host went down, or the link to it did (no "
                    "acknowledgement within SMFREE_LINK_TIMEOUT_MS)");
    case UCS_ERR_UNREACHABLE:
      return concat(said, ": no route to its host");
    default:
      return said;
  }
}

void checkUcx(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK) fail("UCX ", what, " failed: ", ucxStatusText(status));
}

}  // namespace smfree::engine
