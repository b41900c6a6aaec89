#include "engine/cuda/IpcMemory.h"

#include "engine/Error.h"
#include "engine/Log.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {

IpcExport exportBuffer(void* pointer, int device) {
  const Driver& d = driver();
  ContextGuard context(device);
  IpcExport out;
  out.device = device;
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto address = reinterpret_cast<CUdeviceptr>(pointer);
  check(d.cuMemGetAddressRange(&base, &size, address), "cuMemGetAddressRange");
  unsigned long long bufferId = 0;
  check(d.cuPointerGetAttribute(&bufferId, CU_POINTER_ATTRIBUTE_BUFFER_ID, base),
        "cuPointerGetAttribute(BUFFER_ID)");
  const CUresult exported = d.cuIpcGetMemHandle(&out.handle, base);
  if (exported != CUDA_SUCCESS) {
    fail("cannot export a CUDA buffer for IPC (", errorText(exported),
         "); memory from cuMemCreate, as with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,"
         " is not supported by smfree yet");
  }
  out.base = base;
  out.bufferId = bufferId;
  out.offset = address - base;
  return out;
}

IpcCache::~IpcCache() {
  for (auto& [key, entry] : entries_) close(entry);
  for (auto& entry : closing_) close(entry);
}

void* IpcCache::acquire(const std::string& peer, const IpcExport& exported, int localDevice) {
  const Key key{peer, exported.base};
  auto it = entries_.find(key);
  if (it != entries_.end() &&
      (it->second.bufferId != exported.bufferId || it->second.localDevice != localDevice)) {
    // The owner reused the address for a new allocation: this mapping is stale.
    Entry stale = it->second;
    lru_.erase(stale.lru);
    entries_.erase(it);
    if (stale.inFlight > 0) {
      closing_.push_back(stale);
    } else {
      close(stale);
    }
    it = entries_.end();
  }
  if (it == entries_.end()) {
    evict();
    Entry entry;
    entry.peer = peer;
    entry.bufferId = exported.bufferId;
    entry.localDevice = localDevice;
    ContextGuard context(localDevice);
    check(driver().cuIpcOpenMemHandle(&entry.mapped, exported.handle,
                                      CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
          "cuIpcOpenMemHandle");
    lru_.push_front(key);
    entry.lru = lru_.begin();
    it = entries_.emplace(key, entry).first;
  } else {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  ++it->second.inFlight;
  return reinterpret_cast<void*>(it->second.mapped + exported.offset);
}

void IpcCache::done(const std::string& peer, const IpcExport& exported) {
  auto it = entries_.find({peer, exported.base});
  if (it != entries_.end() && it->second.bufferId == exported.bufferId) {
    --it->second.inFlight;
    return;
  }
  for (auto entry = closing_.begin(); entry != closing_.end(); ++entry) {
    if (entry->peer == peer && entry->bufferId == exported.bufferId && --entry->inFlight == 0) {
      close(*entry);
      closing_.erase(entry);
      return;
    }
  }
}

void IpcCache::dropPeer(const std::string& peer) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first.first == peer && it->second.inFlight == 0) {
      close(it->second);
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
      close(it->second);
      entries_.erase(it);
      key = lru_.erase(key);  // the next older one is before it
    }
  }
}

void IpcCache::close(Entry& entry) {
  if (!entry.mapped) return;
  ContextGuard context(entry.localDevice);
  const CUresult result = driver().cuIpcCloseMemHandle(entry.mapped);
  if (result != CUDA_SUCCESS) {
    log(LogLevel::kWarn, "cuIpcCloseMemHandle failed: ", errorText(result));
  }
  entry.mapped = 0;
}

}  // namespace smfree::engine::cuda
