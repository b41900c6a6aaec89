#pragma once

#include <cuda.h>

#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <utility>

namespace smfree::engine::cuda {

// Where a buffer lives, in a form another process of this host can map.
struct IpcExport {
  CUipcMemHandle handle{};
  uint64_t base = 0;      // the allocation's base address in the owner
  uint64_t bufferId = 0;  // CU_POINTER_ATTRIBUTE_BUFFER_ID: never reused within the owner
  uint64_t offset = 0;    // of the buffer within the allocation
  int device = -1;
};

// The owner's side: exports the allocation holding a device pointer.
IpcExport exportBuffer(void* pointer, int device);

// The importer's side: one mapping per peer allocation, opened in the context of the device
// that issues the copies. A stale entry (the owner freed and reallocated at the same base)
// is recognised by its buffer id and replaced. At most `capacity` mappings stay open;
// the least recently used mapping without copies in flight is closed first.
class IpcCache {
 public:
  explicit IpcCache(size_t capacity) : capacity_(capacity) {}
  ~IpcCache();
  IpcCache(const IpcCache&) = delete;
  IpcCache& operator=(const IpcCache&) = delete;

  // Mapped address of the exported buffer; counts a copy in flight until done() is called.
  void* acquire(const std::string& peer, const IpcExport& exported, int localDevice);
  void done(const std::string& peer, const IpcExport& exported);
  // Closes every mapping of a peer that has none in flight (the peer is gone).
  void dropPeer(const std::string& peer);
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string peer;
    uint64_t bufferId = 0;
    CUdeviceptr mapped = 0;
    int localDevice = -1;
    int inFlight = 0;
    std::list<std::pair<std::string, uint64_t>>::iterator lru;
  };
  using Key = std::pair<std::string, uint64_t>;  // (peer, base)

  void close(Entry& entry);
  void evict();

  size_t capacity_;
  std::map<Key, Entry> entries_;
  std::list<Key> lru_;  // most recent first
  std::list<Entry> closing_;  // replaced while copies were in flight
};

}  // namespace smfree::engine::cuda
