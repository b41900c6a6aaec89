#pragma once

#include <ucp/api/ucp.h>

#include <string>

namespace smfree::engine {

std::string ucxStatusText(ucs_status_t status);
// What an endpoint's error says of its peer: UCX's words, and what they mean there.
std::string ucxPeerErrorText(ucs_status_t status);
// Throws "UCX <what> failed: <status>" unless `status` is UCS_OK.
void checkUcx(ucs_status_t status, const std::string& what);

}  // namespace smfree::engine
