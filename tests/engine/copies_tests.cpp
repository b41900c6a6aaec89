// Where copies go: a copy within one GPU bounces only where SMFREE_LOCAL_COPIES says so, and
// never one that crosses a device boundary; bounces come in powers of two from 1 to 16 MiB, and
// 32 MiB for a copy past one chunk, whose two lanes take a half each.

#include "engine/cuda/Copies.h"

#include "check.h"

using namespace smfree::engine;
using cuda::LocalCopies;
using cuda::Place;

namespace {

TEST(copiesBounceOnlyWithinOneGpu, "copies: within one GPU bounce as the setting says") {
  const Place gpu0{0x1000, 0};
  const Place gpu0b{0x2000, 0};
  const Place gpu1{0x3000, 1};
  const Place host{0x4000, cuda::kHostMemory};
  cuda::setLocalCopies(LocalCopies::kDriver);
  CHECK(!cuda::bounced(gpu0, gpu0b));  // the driver's copy
  for (const LocalCopies how : {LocalCopies::kPeerGpu, LocalCopies::kHost}) {
    cuda::setLocalCopies(how);
    CHECK(cuda::bounced(gpu0, gpu0b));
    CHECK(!cuda::bounced(gpu1, gpu0));
    CHECK(!cuda::bounced(host, gpu0));
    CHECK(!cuda::bounced(gpu0, host));
  }
  cuda::setLocalCopies(LocalCopies::kDriver);
}

TEST(bouncesInPowersOfTwo, "copies: a bounce is a power of two from 1 to 16 MiB; 32 past it") {
  constexpr uint64_t kMiB = 1ull << 20;
  CHECK(cuda::bounceBytesFor(4) == kMiB);
  CHECK(cuda::bounceBytesFor(kMiB) == kMiB);
  CHECK(cuda::bounceBytesFor(kMiB + 1) == 2 * kMiB);
  CHECK(cuda::bounceBytesFor(3 * kMiB) == 4 * kMiB);
  CHECK(cuda::bounceBytesFor(cuda::kChunkBytes) == cuda::kChunkBytes);
  // Past one chunk, two lanes of chunks take a half each.
  CHECK(cuda::bounceBytesFor(cuda::kChunkBytes + 1) == 2 * cuda::kChunkBytes);
  CHECK(cuda::bounceBytesFor(256 * kMiB) == cuda::kMaxBounceBytes);
  CHECK(cuda::kMaxBounceBytes == 2 * cuda::kChunkBytes);
}

}  // namespace
