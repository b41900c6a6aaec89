#include "engine/transports/ucx/UcxStatus.h"

#include "engine/Error.h"

namespace smfree::engine {

std::string ucxStatusText(ucs_status_t status) { return ucs_status_string(status); }

void checkUcx(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK) fail("UCX ", what, " failed: ", ucxStatusText(status));
}

}  // namespace smfree::engine
