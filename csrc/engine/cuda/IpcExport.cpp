#include "engine/cuda/IpcExport.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "engine/Error.h"
#include "engine/PeerValue.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {
namespace {

// The fixed part of an export on the wire; its chunks follow.
struct Header {
  uint32_t kind;
  int32_t device;
  uint64_t address;
  CUipcMemHandle handle;
  uint64_t base;
  uint64_t bufferId;
  uint32_t chunks;
  uint32_t unused;
};

uint64_t attribute(CUdeviceptr address, CUpointer_attribute which, const char* what) {
  uint64_t value = 0;  // zero-filled: some attributes are 4 bytes wide
  check(driver().cuPointerGetAttribute(&value, which, address), what);
  return value;
}

std::optional<uint64_t> idAt(uint64_t address, bool chunk) {
  uint64_t value = 0;
  const CUresult result = driver().cuPointerGetAttribute(
      &value, chunk ? CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID : CU_POINTER_ATTRIBUTE_BUFFER_ID,
      address);
  if (result != CUDA_SUCCESS) return std::nullopt;  // freed or unmapped
  return value;
}

}  // namespace

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

IpcExport IpcExporter::exportBuffer(void* pointer, uint64_t bytes, int device,
                                    const std::string& peer) {
  ContextGuard context(device);
  const auto address = reinterpret_cast<CUdeviceptr>(pointer);
  IpcExport e;
  e.device = device;
  e.address = address;
  if (attribute(address, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)")) {
    CUdeviceptr base = 0;
    size_t size = 0;
    check(driver().cuMemGetAddressRange(&base, &size, address), "cuMemGetAddressRange");
    Exported& allocation = allocationAt(base, device);
    allocation.peers.insert(peer);
    e.kind = IpcExport::Kind::kIpcHandle;
    e.handle = allocation.handle;
    e.base = base;
    e.bufferId = allocation.id;
    return e;
  }
  const uint64_t handleTypes = attribute(address, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
                                         "cuPointerGetAttribute(ALLOWED_HANDLE_TYPES)");
  if (!(handleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    fail("cannot share a CUDA buffer of ", bytes, " B on cuda:", device,
         " with another process: it is neither from cudaMalloc nor from cuMemCreate with a POSIX"
         " file descriptor handle type (allowed handle type mask ", handleTypes,
         "; a cudaMallocAsync pool?)");
  }
  e.kind = IpcExport::Kind::kShareable;
  const CUdeviceptr end = address + std::max<uint64_t>(bytes, 1);
  for (CUdeviceptr at = address; at < end;) {
    const uint64_t base = attribute(at, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                                    "cuPointerGetAttribute(MAPPING_BASE_ADDR)");
    Exported& chunk = chunkAt(base, device);
    chunk.peers.insert(peer);
    e.chunks.push_back(IpcChunk{base, chunk.size, chunk.id, chunk.fd->get(), 0});
    at = base + chunk.size;
  }
  return e;
}

IpcExporter::Exported& IpcExporter::allocationAt(uint64_t base, int device) {
  const uint64_t id =
      attribute(base, CU_POINTER_ATTRIBUTE_BUFFER_ID, "cuPointerGetAttribute(BUFFER_ID)");
  auto it = exported_.find(base);
  if (it != exported_.end() && !it->second.chunk && it->second.id == id) return it->second;
  if (it != exported_.end()) retire(it);
  Exported allocation;
  allocation.device = device;
  allocation.id = id;
  check(driver().cuIpcGetMemHandle(&allocation.handle, base), "cuIpcGetMemHandle");
  return exported_.emplace(base, std::move(allocation)).first->second;
}

IpcExporter::Exported& IpcExporter::chunkAt(uint64_t base, int device) {
  const Driver& d = driver();
  const uint64_t id = attribute(base, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID,
                                "cuPointerGetAttribute(MEMORY_BLOCK_ID)");
  auto it = exported_.find(base);
  if (it != exported_.end() && it->second.chunk && it->second.id == id) return it->second;
  if (it != exported_.end()) retire(it);
  Exported chunk;
  chunk.device = device;
  chunk.id = id;
  chunk.chunk = true;
  chunk.size =
      attribute(base, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, "cuPointerGetAttribute(MAPPING_SIZE)");
  CUmemGenericAllocationHandle handle = 0;
  check(d.cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(base)),
        "cuMemRetainAllocationHandle");
  int fd = -1;
  const CUresult exported =
      d.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  d.cuMemRelease(handle);  // the retain took a reference; the owner's mapping holds the memory
  check(exported, "cuMemExportToShareableHandle(POSIX FD)");
  chunk.fd.emplace(fd);
  return exported_.emplace(base, std::move(chunk)).first->second;
}

void IpcExporter::retire(std::map<uint64_t, Exported>::iterator it) {
  for (const std::string& peer : it->second.peers) released_[peer].push_back(it->second.id);
  exported_.erase(it);
}

std::map<std::string, std::vector<uint64_t>> IpcExporter::sweep() {
  for (auto it = exported_.begin(); it != exported_.end();) {
    ContextGuard context(it->second.device);
    if (idAt(it->first, it->second.chunk) == it->second.id) {
      ++it;
      continue;
    }
    auto gone = it++;
    retire(gone);
  }
  return std::exchange(released_, {});
}

void IpcExport::appendTo(std::string& out) const {
  Header header{};
  header.kind = static_cast<uint32_t>(kind);
  header.device = device;
  header.address = address;
  header.handle = handle;
  header.base = base;
  header.bufferId = bufferId;
  header.chunks = static_cast<uint32_t>(chunks.size());
  out.append(reinterpret_cast<const char*>(&header), sizeof(header));
  out.append(reinterpret_cast<const char*>(chunks.data()), chunks.size() * sizeof(IpcChunk));
}

IpcExport IpcExport::read(const char* data, size_t size) {
  Header header{};
  if (size < sizeof(header)) {
    badPeerValue("buffer export", "length", size, " B, shorter than its ", sizeof(header),
                 " B header");
  }
  std::memcpy(&header, data, sizeof(header));
  const size_t expected = sizeof(header) + static_cast<size_t>(header.chunks) * sizeof(IpcChunk);
  const auto kind = static_cast<Kind>(header.kind);
  if (size != expected || (kind != Kind::kIpcHandle && kind != Kind::kShareable) ||
      (kind == Kind::kShareable) != (header.chunks > 0)) {
    badPeerValue("buffer export", "kind", header.kind, " with ", header.chunks, " chunks in ", size,
                 " B");
  }
  IpcExport e;
  e.kind = kind;
  e.device = header.device;
  e.address = header.address;
  e.handle = header.handle;
  e.base = header.base;
  e.bufferId = header.bufferId;
  e.chunks.resize(header.chunks);
  // memcpy from or to null is undefined even for no bytes: an IPC handle has no chunks.
  if (header.chunks > 0) {
    std::memcpy(e.chunks.data(), data + sizeof(header), header.chunks * sizeof(IpcChunk));
  }
  for (size_t i = 0; i < e.chunks.size(); ++i) {
    const IpcChunk& chunk = e.chunks[i];
    // The span mapped (last end - first base) must neither wrap nor be empty.
    if (chunk.size == 0 || chunk.base + chunk.size < chunk.base) {
      badPeerValue("buffer export", "chunk size", "chunk ", i, " of ", chunk.size, " B at ",
                   chunk.base);
    }
    if (i > 0 && chunk.base != e.chunks[i - 1].base + e.chunks[i - 1].size) {
      badPeerValue("buffer export", "chunk base", "chunk ", i, " does not follow chunk ", i - 1);
    }
  }
  return e;
}

}  // namespace smfree::engine::cuda
