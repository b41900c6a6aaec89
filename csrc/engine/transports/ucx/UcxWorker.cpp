#include "engine/transports/ucx/UcxWorker.h"

#include <cstdlib>
#include <memory>

#include "engine/Error.h"

namespace smfree::engine {
namespace {

void check(ucs_status_t status, const char* what) {
  if (status != UCS_OK) {
    fail("UCX ", what, " failed: ", ucxStatusText(status));
  }
}

struct ConfigDeleter {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};

// Replaces one of UCX's defaults; the user's UCX_<name> wins.
void setDefault(ucp_config_t* config, const std::string& name, const std::string& value) {
  if (std::getenv(("UCX_" + name).c_str())) return;
  check(ucp_config_modify(config, name.c_str(), value.c_str()), ("setting " + name).c_str());
}

std::unique_ptr<ucp_config_t, ConfigDeleter> readConfig(const Config& config) {
  ucp_config_t* raw = nullptr;
  check(ucp_config_read(nullptr, nullptr, &raw), "ucp_config_read");
  std::unique_ptr<ucp_config_t, ConfigDeleter> owned(raw);
  // UCX's default keepalive (tens of seconds) would leave ops to a dead peer hanging that long.
  setDefault(owned.get(), "KEEPALIVE_INTERVAL", concat(config.peerCheck.count(), "ms"));
  // With UCX's 8 KiB TCP send segments, one TCP connection moved 1.6 GB/s of 16 MiB messages
  // (ucx_perftest tag_bw, loopback); 64 KiB segments moved 5.5 GB/s. A rank with one NIC
  // toward a peer on another host has one such connection.
  setDefault(owned.get(), "TCP_TX_SEG_SIZE", "64K");
  return owned;
}

}  // namespace

std::string ucxStatusText(ucs_status_t status) { return ucs_status_string(status); }

UcxWorker::UcxWorker(const Config& config) {
  auto ucxConfig = readConfig(config);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  params.name = "smfree";
  check(ucp_init(&params, ucxConfig.get(), &context_), "ucp_init");

  ucp_worker_params_t workerParams{};
  workerParams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  workerParams.thread_mode = UCS_THREAD_MODE_SINGLE;
  const ucs_status_t created = ucp_worker_create(context_, &workerParams, &worker_);
  if (created != UCS_OK) {
    ucp_cleanup(context_);
    check(created, "ucp_worker_create");
  }
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t status = ucp_worker_get_address(worker_, &address, &length);
  if (status == UCS_OK) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(address);
    address_.assign(bytes, bytes + length);
    ucp_worker_release_address(worker_, address);
    status = ucp_worker_get_efd(worker_, &eventFd_);
  }
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    check(status, "worker address or event fd");
  }
}

UcxWorker::~UcxWorker() {
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

bool UcxWorker::arm() {
  const ucs_status_t status = ucp_worker_arm(worker_);
  if (status == UCS_ERR_BUSY) {
    return false;
  }
  check(status, "ucp_worker_arm");
  return true;
}

}  // namespace smfree::engine
