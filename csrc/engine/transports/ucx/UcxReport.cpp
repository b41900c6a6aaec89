#include "engine/transports/ucx/UcxReport.h"

#include <dlfcn.h>
#include <ucp/api/ucp.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "engine/Error.h"
#include "engine/transports/ucx/UcxStatus.h"

namespace smfree::engine {
namespace {

struct ContextDeleter {
  void operator()(ucp_context* context) const { ucp_cleanup(context); }
};

// ucp_context_print_info writes lines like "#   resource 3  :  md 2  dev 2  flags -- tcp/lo".
std::vector<std::string> resourcesIn(const std::string& info) {
  std::vector<std::string> resources;
  std::istringstream lines(info);
  for (std::string line; std::getline(lines, line);) {
    const auto marker = line.find("flags -- ");
    if (line.find("resource") != std::string::npos && marker != std::string::npos) {
      resources.push_back(line.substr(marker + 9));
    }
  }
  return resources;
}

}  // namespace

bool ucxHasTcpUserTimeout() {
  static const bool has = dlsym(RTLD_DEFAULT, "ucs_tcp_base_set_user_timeout") != nullptr;
  return has;
}

std::string ucxCutLinkUnnoticed(std::chrono::milliseconds linkTimeout) {
  if (!ucxHasTcpUserTimeout()) {
    return concat("UCX ", ucp_get_version_string(), " has no TCP user timeout, so it cannot "
                  "notice a cut link sooner");
  }
  if (linkTimeout.count() == 0 && !std::getenv("UCX_TCP_USER_TIMEOUT")) {
    return "SMFREE_LINK_TIMEOUT_MS is 0, so only the kernel's TCP retransmissions, after "
           "minutes, end the connection of a cut link";
  }
  return {};
}

UcxReport ucxReport() {
  UcxReport report;
  report.version = ucp_get_version_string();
  report.tcpUserTimeout = ucxHasTcpUserTimeout();
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h raw = nullptr;
  checkUcx(ucp_init(&params, nullptr, &raw), "ucp_init");
  std::unique_ptr<ucp_context, ContextDeleter> context(raw);
  char* buffer = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&buffer, &size);
  if (!stream) {
    fail("open_memstream failed");
  }
  ucp_context_print_info(context.get(), stream);
  std::fclose(stream);
  const std::string info(buffer, size);
  std::free(buffer);
  report.resources = resourcesIn(info);
  return report;
}

}  // namespace smfree::engine
