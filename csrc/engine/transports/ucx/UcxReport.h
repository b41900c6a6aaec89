#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace smfree::engine {

// What `python -m smfree_pg.doctor` shows of UCX: its version and the transports and devices
// a context opened with smfree's features finds here (e.g. "posix/memory", "tcp/eth0").
struct UcxReport {
  std::string version;
  std::vector<std::string> resources;
  bool tcpUserTimeout = false;  // ucxHasTcpUserTimeout()
};

UcxReport ucxReport();

// Whether the loaded UCX can set TCP_USER_TIMEOUT on its sockets (UCX_TCP_USER_TIMEOUT). Older
// ones (Debian's 1.13) have no such setting and ignore it: a link cut mid-transfer then fails
// its ops only at the group timeout. Told by the helper UCX sets it with.
bool ucxHasTcpUserTimeout();

// Why a link to another host cut during a transfer is noticed only at the group timeout here:
// this UCX has no TCP user timeout, or SMFREE_LINK_TIMEOUT_MS is 0 (and UCX_TCP_USER_TIMEOUT
// unset). Empty where UCX fails such a connection after the link timeout.
std::string ucxCutLinkUnnoticed(std::chrono::milliseconds linkTimeout);

}  // namespace smfree::engine
