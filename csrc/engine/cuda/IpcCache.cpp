#include "engine/cuda/IpcCache.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/PeerValue.h"
#include "engine/cuda/CudaDriver.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace smfree::engine::cuda {
namespace {

// A duplicate, in this process, of a file descriptor open in the owner.
int takeFd(int ownerPidfd, int ownerFd) {
  if (ownerPidfd < 0) {
    fail("cannot map a peer's cuMemCreate (expandable_segments) memory: no pidfd for the peer"
         " process (pidfd_open needs Linux 5.3+)");
  }
  const long fd = syscall(SYS_pidfd_getfd, ownerPidfd, ownerFd, 0);
  if (fd < 0) {
    fail("cannot map a peer's cuMemCreate (expandable_segments) memory: pidfd_getfd failed: ",
         std::strerror(errno), " (it needs Linux 5.6+ and ptrace permission over the peer)");
  }
  return static_cast<int>(fd);
}

void warnOnError(CUresult result, const char* what) {
  if (result != CUDA_SUCCESS) log(LogLevel::kWarn, what, " failed: ", errorText(result));
}

}  // namespace

PeerMapping::PeerMapping(const IpcExport& exported, int ownerPidfd, int localDevice)
    : kind_(exported.kind), localDevice_(localDevice) {
  ContextGuard context(localDevice);
  if (kind_ == IpcExport::Kind::kIpcHandle) {
    openIpcHandle(exported);
    return;
  }
  try {
    mapChunks(exported, ownerPidfd);
  } catch (...) {
    close();  // no destructor runs for a constructor that throws
    throw;
  }
}

void PeerMapping::openIpcHandle(const IpcExport& exported) {
  check(driver().cuIpcOpenMemHandle(&address_, exported.handle,
                                    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
        "cuIpcOpenMemHandle");
  // The handle maps the whole allocation: its size is the driver's word, not the peer's.
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult range = driver().cuMemGetAddressRange(&base, &size, address_);
  if (range != CUDA_SUCCESS) {
    close();  // no destructor runs for a constructor that throws
    check(range, "cuMemGetAddressRange (an opened IPC handle)");
  }
  bytes_ = size;
}

CUdeviceptr PeerMapping::addressOf(const IpcExport& exported, uint64_t bytes) const {
  if (exported.address < exported.start()) {
    badPeerValue("buffer export", "address", exported.address, " is below its allocation's ",
                 exported.start());
  }
  const uint64_t offset = exported.address - exported.start();
  checkWithin("buffer export", "range", offset, bytes, bytes_);
  return address_ + offset;
}

void PeerMapping::mapChunks(const IpcExport& exported, int ownerPidfd) {
  const Driver& d = driver();
  const IpcChunk& last = exported.chunks.back();
  const uint64_t span = last.base + last.size - exported.start();
  check(d.cuMemAddressReserve(&address_, span, 0, 0, 0), "cuMemAddressReserve");
  reserved_ = span;
  bytes_ = span;
  for (const IpcChunk& chunk : exported.chunks) {
    const int fd = takeFd(ownerPidfd, chunk.ownerFd);
    CUmemGenericAllocationHandle handle = 0;
    const CUresult imported = d.cuMemImportFromShareableHandle(
        &handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    ::close(fd);
    check(imported, "cuMemImportFromShareableHandle");
    const uint64_t offset = chunk.base - exported.start();
    const CUresult mapped = d.cuMemMap(address_ + offset, chunk.size, 0, handle, 0);
    d.cuMemRelease(handle);  // the mapping holds the memory from here on
    check(mapped, "cuMemMap");
    mapped_.emplace_back(offset, chunk.size);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = localDevice_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(d.cuMemSetAccess(address_, span, &access, 1), "cuMemSetAccess");
}

PeerMapping::~PeerMapping() { close(); }

void PeerMapping::close() {
  const Driver& d = driver();
  ContextGuard context(localDevice_);
  if (kind_ == IpcExport::Kind::kIpcHandle) {
    if (address_) warnOnError(d.cuIpcCloseMemHandle(address_), "cuIpcCloseMemHandle");
    address_ = 0;
    return;
  }
  for (const auto& [offset, size] : mapped_) {
    warnOnError(d.cuMemUnmap(address_ + offset, size), "cuMemUnmap");
  }
  mapped_.clear();
  if (reserved_) warnOnError(d.cuMemAddressFree(address_, reserved_), "cuMemAddressFree");
  reserved_ = 0;
  address_ = 0;
}

bool IpcCache::maps(const Entry& entry, const IpcExport& exported, int localDevice) {
  if (entry.kind != exported.kind || entry.localDevice != localDevice) return false;
  if (exported.kind == IpcExport::Kind::kIpcHandle) {
    return entry.ids.size() == 1 && entry.ids.front() == exported.bufferId;
  }
  return std::equal(entry.ids.begin(), entry.ids.end(), exported.chunks.begin(),
                    exported.chunks.end(),
                    [](uint64_t id, const IpcChunk& chunk) { return id == chunk.blockId; });
}

void* IpcCache::acquire(const std::string& peer, int ownerPidfd, const IpcExport& exported,
                        int localDevice, uint64_t bytes) {
  const Key key{peer, exported.start()};
  auto it = entries_.find(key);
  if (it != entries_.end() && !maps(it->second, exported, localDevice)) {
    retire(it);  // the owner reused the address for other memory: this mapping is stale
    it = entries_.end();
  }
  if (it == entries_.end()) {
    evict();
    Entry entry;
    entry.peer = peer;
    entry.kind = exported.kind;
    entry.localDevice = localDevice;
    if (exported.kind == IpcExport::Kind::kIpcHandle) entry.ids.push_back(exported.bufferId);
    for (const IpcChunk& chunk : exported.chunks) entry.ids.push_back(chunk.blockId);
    entry.mapping = std::make_unique<PeerMapping>(exported, ownerPidfd, localDevice);
    lru_.push_front(key);
    entry.lru = lru_.begin();
    it = entries_.emplace(key, std::move(entry)).first;
  } else {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  const CUdeviceptr address = it->second.mapping->addressOf(exported, bytes);
  ++it->second.inFlight;
  return reinterpret_cast<void*>(address);
}

void IpcCache::done(const std::string& peer, const IpcExport& exported, int localDevice) {
  auto it = entries_.find({peer, exported.start()});
  if (it != entries_.end() && maps(it->second, exported, localDevice)) {
    --it->second.inFlight;
    return;
  }
  for (auto entry = closing_.begin(); entry != closing_.end(); ++entry) {
    if (entry->peer == peer && maps(*entry, exported, localDevice) && --entry->inFlight == 0) {
      closing_.erase(entry);
      return;
    }
  }
}

void IpcCache::retire(std::map<Key, Entry>::iterator it) {
  lru_.erase(it->second.lru);
  if (it->second.inFlight > 0) closing_.push_back(std::move(it->second));
  entries_.erase(it);
}

void IpcCache::forget(const std::string& peer, const std::vector<uint64_t>& ids) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    const std::vector<uint64_t>& mine = it->second.ids;
    const bool gone = it->first.first == peer &&
                      std::any_of(mine.begin(), mine.end(), [&](uint64_t id) {
                        return std::find(ids.begin(), ids.end(), id) != ids.end();
                      });
    if (gone) {
      retire(it++);
    } else {
      ++it;
    }
  }
}

void IpcCache::dropPeer(const std::string& peer) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first.first == peer && it->second.inFlight == 0) {
      lru_.erase(it->second.lru);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

void IpcCache::evict() {
  auto key = lru_.end();
  while (entries_.size() >= capacity_ && key != lru_.begin()) {
    --key;
    auto it = entries_.find(*key);
    if (it->second.inFlight == 0) {
      entries_.erase(it);
      key = lru_.erase(key);  // the next older one is before it
    }
  }
}

}  // namespace smfree::engine::cuda
