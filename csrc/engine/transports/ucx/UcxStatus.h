#pragma once

#include <ucp/api/ucp.h>

#include <string>

namespace smfree::engine {

std::string ucxStatusText(ucs_status_t status);
// Throws "UCX <what> failed: <status>" unless `status` is UCS_OK.
void checkUcx(ucs_status_t status, const std::string& what);

}  // namespace smfree::engine
