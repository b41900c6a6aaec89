// Buffer exports: how a CUDA buffer is described to the peer that maps it.

#include <string>

#include "engine/cuda/IpcExport.h"

#include "check.h"

using namespace smfree::engine;

namespace {

cuda::IpcExport chunkedExport() {
  cuda::IpcExport e;
  e.kind = cuda::IpcExport::Kind::kShareable;
  e.device = 1;
  e.address = (64ull << 20) + 4096;
  e.chunks = {{64ull << 20, 20ull << 20, 7, 31, 0}, {84ull << 20, 20ull << 20, 9, 32, 0}};
  return e;
}

bool readFails(const std::string& bytes, const char* expected) {
  return testing::throwsError([&] { cuda::IpcExport::read(bytes.data(), bytes.size()); }, expected);
}

TEST(bufferExportsRoundTrip, "buffer exports round-trip") {
  std::string bytes;
  chunkedExport().appendTo(bytes);
  const cuda::IpcExport back = cuda::IpcExport::read(bytes.data(), bytes.size());
  CHECK(back.kind == cuda::IpcExport::Kind::kShareable && back.device == 1);
  CHECK(back.address == (64ull << 20) + 4096 && back.start() == 64ull << 20);
  CHECK(back.chunks.size() == 2 && back.chunks[1].blockId == 9 && back.chunks[1].ownerFd == 32);

  cuda::IpcExport legacy;
  legacy.base = 4096;
  legacy.address = 4096 + 100;
  legacy.bufferId = 77;
  legacy.handle.reserved[0] = 'x';
  std::string legacyBytes;
  legacy.appendTo(legacyBytes);
  const cuda::IpcExport legacyBack = cuda::IpcExport::read(legacyBytes.data(), legacyBytes.size());
  CHECK(legacyBack.kind == cuda::IpcExport::Kind::kIpcHandle && legacyBack.start() == 4096);
  CHECK(legacyBack.bufferId == 77 && legacyBack.handle.reserved[0] == 'x');
  CHECK(legacyBack.chunks.empty());
}

TEST(bufferExportsRejectMalformedBytes, "buffer exports reject malformed bytes") {
  std::string bytes;
  chunkedExport().appendTo(bytes);
  CHECK(readFails(bytes.substr(0, 10), "shorter than its"));
  CHECK(readFails(bytes.substr(0, bytes.size() - 1), "2 chunks in"));
  cuda::IpcExport gap = chunkedExport();
  gap.chunks[1].base += 2ull << 20;
  std::string gapBytes;
  gap.appendTo(gapBytes);
  CHECK(readFails(gapBytes, "chunk 1 does not follow chunk 0"));
  cuda::IpcExport empty = chunkedExport();
  empty.chunks.clear();
  std::string emptyBytes;
  empty.appendTo(emptyBytes);
  CHECK(readFails(emptyBytes, "0 chunks"));
}

}  // namespace
