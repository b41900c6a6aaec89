#pragma once

#include <cuda.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace smfree::engine::cuda {

// One cuMemCreate allocation (a chunk of an expandable segment) that an exported buffer spans.
struct IpcChunk {
  uint64_t base = 0;     // mapped at this address in the owner
  uint64_t size = 0;
  uint64_t blockId = 0;  // CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: never reused within the owner
  int32_t ownerFd = -1;  // POSIX FD of the allocation, open in the owner while the op lives
  int32_t unused = 0;
};

// Where a buffer lives, in a form another process of this host can map. Memory from
// cudaMalloc travels as a legacy IPC handle; memory from cuMemCreate (PyTorch's
// expandable_segments) as the POSIX FDs of the allocations it spans, which the importer
// takes with pidfd_getfd.
struct IpcExport {
  enum class Kind : uint32_t { kIpcHandle = 1, kShareable = 2 };

  Kind kind = Kind::kIpcHandle;
  int32_t device = -1;
  uint64_t address = 0;  // of the buffer, in the owner
  // kIpcHandle: the allocation holding the buffer.
  CUipcMemHandle handle{};
  uint64_t base = 0;
  uint64_t bufferId = 0;  // CU_POINTER_ATTRIBUTE_BUFFER_ID: never reused within the owner
  // kShareable: the allocations holding the buffer, in address order, without gaps.
  std::vector<IpcChunk> chunks;

  // The owner's address of the first mapped byte: what the importer maps starts there.
  uint64_t start() const { return kind == Kind::kIpcHandle ? base : chunks.front().base; }

  void appendTo(std::string& out) const;
  // Throws Error on malformed bytes.
  static IpcExport read(const char* data, size_t size);
};

// A file descriptor this process owns; closed when destroyed.
class OwnedFd {
 public:
  explicit OwnedFd(int fd) : fd_(fd) {}
  ~OwnedFd();
  OwnedFd(OwnedFd&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  OwnedFd& operator=(OwnedFd&&) = delete;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;

  int get() const { return fd_; }

 private:
  int fd_;
};

// The owner's side. Exporting is costly (about 1 ms per cuMemExportToShareableHandle), so each
// allocation or chunk is exported once and its handle or FD kept while it stays mapped at its
// address. It remembers which peers it was exported to: sweep() finds the memory that the
// allocator has since freed or unmapped, so those peers can close their mappings, which would
// otherwise keep the memory alive; and it closes the FDs, which would too.
class IpcExporter {
 public:
  // Exports the `bytes` bytes at `pointer` to the peer named `peer`.
  IpcExport exportBuffer(void* pointer, uint64_t bytes, int device, const std::string& peer);
  // Per peer, the ids (buffer ids, block ids) of exported memory that is no longer mapped where
  // it was; forgets it.
  std::map<std::string, std::vector<uint64_t>> sweep();
  size_t size() const { return exported_.size(); }

 private:
  struct Exported {
    int device = -1;
    uint64_t id = 0;  // buffer id (allocation) or block id (chunk)
    uint64_t size = 0;
    bool chunk = false;
    CUipcMemHandle handle{};        // allocations
    std::optional<OwnedFd> fd;      // chunks
    std::set<std::string> peers;
  };

  Exported& allocationAt(uint64_t address, int device);
  Exported& chunkAt(uint64_t address, int device);
  // Replaces an entry whose memory is gone, reporting it to its peers at the next sweep.
  void retire(std::map<uint64_t, Exported>::iterator it);

  std::map<uint64_t, Exported> exported_;  // by the address of the allocation or chunk
  std::map<std::string, std::vector<uint64_t>> released_;
};
}  // namespace smfree::engine::cuda
