#include "engine/cuda/LocalCopies.h"

#include <atomic>

namespace smfree::engine::cuda {

namespace {
std::atomic<LocalCopies> localCopiesSetting{LocalCopies::kDriver};
}  // namespace

void setLocalCopies(LocalCopies how) { localCopiesSetting.store(how); }

LocalCopies localCopies() { return localCopiesSetting.load(); }

const char* describe(LocalCopies how) {
  switch (how) {
    case LocalCopies::kPeerGpu:
      return "two copy-engine hops through a peer GPU's memory (SMFREE_LOCAL_COPIES=peer_gpu)";
    case LocalCopies::kHost:
      return "two copy-engine hops through pinned host memory (SMFREE_LOCAL_COPIES=host)";
    case LocalCopies::kDriver:
      break;
  }
  return "the driver's copies, which CUDA 13.0 drivers run on SMs (SMFREE_LOCAL_COPIES=driver)";
}

}  // namespace smfree::engine::cuda
