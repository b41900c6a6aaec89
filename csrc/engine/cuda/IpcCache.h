#pragma once

#include <cuda.h>

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/IpcExport.h"

namespace smfree::engine::cuda {

// A peer's exported memory mapped into this process, in the context of the device whose
// streams copy into it (mapped in the peer device's context, copies get staged through host
// memory). Closed when destroyed.
class PeerMapping {
 public:
  // `ownerPidfd` is a pidfd of the owner, used to take the FDs of kShareable exports.
  PeerMapping(const IpcExport& exported, int ownerPidfd, int localDevice);
  ~PeerMapping();
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  // Where the owner's address `start()` of the export is mapped here.
  CUdeviceptr address() const { return address_; }
  // How many bytes are mapped from there: the whole allocation, or the chunks' span.
  uint64_t bytes() const { return bytes_; }
  // Where the export's own address is mapped here, once its `bytes` bytes are found to lie in
  // the mapping: throws BadPeerValue (PeerValue.h) for an export that reaches past it.
  CUdeviceptr addressOf(const IpcExport& exported, uint64_t bytes) const;

 private:
  void openIpcHandle(const IpcExport& exported);
  void mapChunks(const IpcExport& exported, int ownerPidfd);
  void close();

  IpcExport::Kind kind_;
  int localDevice_;
  CUdeviceptr address_ = 0;
  uint64_t bytes_ = 0;
  uint64_t reserved_ = 0;                                // kShareable: address range reserved
  std::vector<std::pair<uint64_t, uint64_t>> mapped_;  // kShareable: (offset, size) mapped
};

// The importer's side: one mapping per peer allocation (or run of chunks). The owner tells
// when it freed or unmapped that memory (forget()); a stale entry met before that message (the
// owner reused the address) is recognised by its buffer or block ids and replaced. At most
// `capacity` mappings stay open; the least recently used one without copies in flight is
// closed first.
class IpcCache {
 public:
  explicit IpcCache(size_t capacity) : capacity_(capacity) {}
  IpcCache(const IpcCache&) = delete;
  IpcCache& operator=(const IpcCache&) = delete;

  // Mapped address of the exported buffer, whose `bytes` bytes must lie in the mapping
  // (PeerMapping::addressOf); counts a copy in flight until done() is called.
  void* acquire(const std::string& peer, int ownerPidfd, const IpcExport& exported,
                int localDevice, uint64_t bytes);
  void done(const std::string& peer, const IpcExport& exported, int localDevice);
  // Closes the peer's mappings of memory with these buffer or block ids (the owner freed or
  // unmapped it), each once its copies are done.
  void forget(const std::string& peer, const std::vector<uint64_t>& ids);
  // Closes every mapping of a peer that has none in flight (the peer is gone).
  void dropPeer(const std::string& peer);
  size_t size() const { return entries_.size(); }

 private:
  using Key = std::pair<std::string, uint64_t>;  // (peer, owner's start address)
  struct Entry {
    std::string peer;
    IpcExport::Kind kind = IpcExport::Kind::kIpcHandle;
    int localDevice = -1;
    std::vector<uint64_t> ids;  // buffer id or block ids of what is mapped
    std::unique_ptr<PeerMapping> mapping;
    int inFlight = 0;
    std::list<Key>::iterator lru;
  };

  // Whether the entry maps this memory for this device: the owner never reuses an id.
  static bool maps(const Entry& entry, const IpcExport& exported, int localDevice);
  void retire(std::map<Key, Entry>::iterator it);
  void evict();

  size_t capacity_;
  std::map<Key, Entry> entries_;
  std::list<Key> lru_;        // most recent first
  std::list<Entry> closing_;  // replaced while copies were in flight
};

}  // namespace smfree::engine::cuda
