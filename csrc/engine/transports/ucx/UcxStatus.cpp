#include "engine/transports/ucx/UcxStatus.h"

#include "engine/Error.h"

namespace smfree::engine {

std::string ucxStatusText(ucs_status_t status) { return ucs_status_string(status); }

std::string ucxPeerErrorText(ucs_status_t status) {
  const std::string said = concat("UCX reported '", ucxStatusText(status), "'");
  switch (status) {
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_TIMED_OUT:
      return concat(said, " on the connection to it: bytes went unacknowledged past the link "
                    "timeout (SMFREE_LINK_TIMEOUT_MS); its link or its host is down");
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
