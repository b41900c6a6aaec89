#include "engine/transports/ucx/UcxContext.h"

#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>

#include "engine/Error.h"
#include "engine/transports/ucx/UcxReport.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {
namespace {

struct ConfigDeleter {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};

// Replaces one of UCX's defaults; the user's UCX_<name> wins. `key` is the name
// ucp_config_modify takes, where it differs.
void setDefault(ucp_config_t* config, const std::string& name, const std::string& value,
                const std::string& key = {}) {
  if (std::getenv(("UCX_" + name).c_str())) return;
  const std::string& modified = key.empty() ? name : key;
  checkUcx(ucp_config_modify(config, modified.c_str(), value.c_str()), "setting " + name);
}

// UCX before 1.17 names a transport's settings without its prefix when they are modified
// through ucp_config_modify (and warns that "TCP_TX_SEG_SIZE" is unused); later UCX takes the
// prefixed name. Only TCP has the settings set here.
std::string tcpKey(const std::string& name) {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return (major > 1 || (major == 1 && minor >= 17)) ? "TCP_" + name : name;
}

// Whether UCX_TLS leaves TCP in; UCX before 1.17 warns of TCP settings when it does not.
bool tcpAllowed() {
  const char* tls = std::getenv("UCX_TLS");
  if (!tls) return true;
  const bool excluding = tls[0] == '^';  // "^a,b": every transport but these
  std::stringstream list(tls + (excluding ? 1 : 0));
  std::string name;
  while (std::getline(list, name, ',')) {
    if (name == "tcp") return !excluding;
    if (name == "all" && !excluding) return true;
  }
  return excluding;
}

std::unique_ptr<ucp_config_t, ConfigDeleter> readConfig(const Config& config) {
  ucp_config_t* raw = nullptr;
  checkUcx(ucp_config_read(nullptr, nullptr, &raw), "ucp_config_read");
  std::unique_ptr<ucp_config_t, ConfigDeleter> owned(raw);
  // UCX's default keepalive (tens of seconds) would leave ops to a dead peer hanging that long.
  setDefault(owned.get(), "KEEPALIVE_INTERVAL", concat(config.peerCheck.count(), "ms"));
  // With UCX's 8 KiB TCP send segments, one TCP connection moved 1.6 GB/s of 16 MiB messages
  // (ucx_perftest tag_bw, loopback); 64 KiB segments moved 5.5 GB/s. A rank with one NIC
  // toward a peer on another host has one such connection.
  if (tcpAllowed()) {
    setDefault(owned.get(), "TCP_TX_SEG_SIZE", "64K", tcpKey("TX_SEG_SIZE"));
    // A connection whose bytes go unacknowledged (a cut link, a host gone) otherwise fails
    // only after the kernel's retransmissions, about 15 minutes. A UCX without the setting
    // would warn of it (the engine says what that means once a peer on another host comes).
    if (config.linkTimeout.count() > 0 && ucxHasTcpUserTimeout()) {
      setDefault(owned.get(), "TCP_USER_TIMEOUT", concat(config.linkTimeout.count(), "ms"),
                 tcpKey("USER_TIMEOUT"));
    }
  }
  return owned;
}

}  // namespace

UcxContext::UcxContext(const Config& config) {
  auto ucxConfig = readConfig(config);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;  // the engine's worker and the receive worker, two threads
  params.name = "smfree";
  checkUcx(ucp_init(&params, ucxConfig.get(), &context_), "ucp_init");
}

UcxContext::~UcxContext() {
  // Cleaning up under a live worker frees what the worker uses.
  if (workers_.load() != 0) return;
  ucp_cleanup(context_);
}

}  // namespace smfree::engine
