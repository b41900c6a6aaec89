#pragma once

namespace smfree::engine::cuda {

// How a copy within one GPU runs (SMFREE_LOCAL_COPIES): in two copy-engine hops through a
// bounce on a peer GPU (NVLink) or in pinned host memory (PCIe); or as the driver's copy, which
// CUDA 13.0 drivers run as a kernel on SMs.
enum class LocalCopies { kDriver, kPeerGpu, kHost };

// Set once by the engine, before its first copy; kDriver until then.
void setLocalCopies(LocalCopies how);
LocalCopies localCopies();
// For the log: what `how` runs on.
const char* describe(LocalCopies how);

}  // namespace smfree::engine::cuda
