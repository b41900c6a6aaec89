#include "engine/Config.h"

#include <cstdlib>
#include <string>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/CudaOps.h"

namespace smfree::engine {
namespace {

// A setting renamed: refused under its old name, so that a job's old spelling is not ignored.
void refuseRenamed(const char* old, const char* now) {
  if (const char* value = std::getenv(old)) {
    fail(old, "='", value, "' is no longer read: set ", now, " instead (same values)");
  }
}

CudaChannel parseCudaChannel(const char* text) {
  const std::string value = text && *text ? text : "auto";
  if (value == "auto") return CudaChannel::kAuto;
  if (value == "copy_engine") return CudaChannel::kCopyEngine;
  if (value == "ucx") return CudaChannel::kUcx;
  fail("SMFREE_CHANNEL='", value, "' is not one of auto, copy_engine, ucx");
}

cuda::LocalCopies parseLocalCopies(const char* text) {
  const std::string value = text && *text ? text : "peer_gpu";
  if (value == "driver") return cuda::LocalCopies::kDriver;
  if (value == "peer_gpu") return cuda::LocalCopies::kPeerGpu;
  if (value == "host") return cuda::LocalCopies::kHost;
  fail("SMFREE_LOCAL_COPIES='", value, "' is not one of driver, peer_gpu, host");
}

// A count that must lie in [low, high].
size_t parseBetween(const char* name, long fallback, long low, long high) {
  const long value = parseNonNegative(name, fallback);
  if (value < low || value > high) {
    fail(name, " must be between ", low, " and ", high);
  }
  return static_cast<size_t>(value);
}

// torchrun's variable, not ours: a value that is not a count is ignored.
std::optional<long> parseLocalRanks() {
  const char* text = std::getenv("LOCAL_WORLD_SIZE");
  if (!text || !*text) return std::nullopt;
  char* end = nullptr;
  const long ranks = std::strtol(text, &end, 10);
  if (*end != '\0' || ranks < 1) return std::nullopt;
  return ranks;
}

}  // namespace

long parseNonNegative(const char* name, long fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) {
    return fallback;
  }
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < 0) {
    fail(name, "='", text, "' is not a non-negative integer");
  }
  return value;
}

Config Config::fromEnv() {
  Config config;
  logLevel();  // a bad SMFREE_LOG_LEVEL fails the engine's start, as the other settings do
  if (const char* spin = std::getenv("SMFREE_SPIN_US"); spin && *spin) {
    config.spin = std::chrono::microseconds(parseNonNegative("SMFREE_SPIN_US", 0));
  }
  config.localRanks = parseLocalRanks();
  config.peerCheck = std::chrono::milliseconds(parseNonNegative("SMFREE_PEER_CHECK_MS", 1000));
  config.linkTimeout =
      std::chrono::milliseconds(parseNonNegative("SMFREE_LINK_TIMEOUT_MS", 10000));
  config.exitTimeout =
      std::chrono::milliseconds(parseNonNegative("SMFREE_EXIT_TIMEOUT_MS", 10000));
  config.ipcCacheSize = static_cast<size_t>(parseNonNegative("SMFREE_IPC_CACHE_SIZE", 1024));
  if (config.ipcCacheSize == 0) {
    fail("SMFREE_IPC_CACHE_SIZE must be at least 1");
  }
  constexpr long kMostCudaOps = (cuda::FlagSegment::kWords - kStagingFlagWords) / kFlagsPerCudaOp;
  config.maxCudaOps = parseBetween("SMFREE_MAX_CUDA_OPS", 1024, 1, kMostCudaOps);
  refuseRenamed("SMFREE_TRANSPORT", "SMFREE_CHANNEL");
  refuseRenamed("SMFREE_HOST_STAGING_PIECE_BYTES", "SMFREE_RELAY_PIECE_BYTES");
  config.cudaChannel = parseCudaChannel(std::getenv("SMFREE_CHANNEL"));
  config.localCopies = parseLocalCopies(std::getenv("SMFREE_LOCAL_COPIES"));
  // A staged send's copy out of its slot is a copy within one GPU: on the driver's copies it
  // saves the sender's copy engine a wait, bounced it costs two hops more than that wait.
  const long staging = config.localCopies == cuda::LocalCopies::kDriver ? 16 << 20 : 0;
  config.stagingBytes =
      static_cast<uint64_t>(parseNonNegative("SMFREE_STAGING_BYTES", staging));
  config.eagerBytes = static_cast<uint64_t>(parseNonNegative("SMFREE_EAGER_BYTES", 16 << 20));
  const long lanes = parseNonNegative("SMFREE_COLLECTIVE_LANES", 1);
  if (lanes > 1) fail("SMFREE_COLLECTIVE_LANES must be 0 (off) or 1 (on)");
  config.collectiveLanes = lanes == 1;
  config.ringMemoryBytes =
      static_cast<uint64_t>(parseNonNegative("SMFREE_RING_MEMORY_BYTES", 1l << 30));
  config.relayPieceBytes =
      static_cast<uint64_t>(parseNonNegative("SMFREE_RELAY_PIECE_BYTES", 4 << 20));
  return config;
}

}  // namespace smfree::engine
