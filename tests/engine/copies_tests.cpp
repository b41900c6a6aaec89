// Where copies go: a copy within one GPU bounces only where SMFREE_LOCAL_COPIES says so, and
// never one that crosses a device boundary; bounces come in powers of two from 1 to 16 MiB.

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

TEST(bouncesInPowersOfTwo, "copies: a bounce is a power of two from 1 MiB to 16 MiB") {
  CHECK(cuda::bounceBytesFor(4) == 1ull << 20);
  CHECK(cuda::bounceBytesFor(1ull << 20) == 1ull << 20);
  CHECK(cuda::bounceBytesFor((1ull << 20) + 1) == 2ull << 20);
  CHECK(cuda::bounceBytesFor(3ull << 20) == 4ull << 20);
  CHECK(cuda::bounceBytesFor(256ull << 20) == cuda::kMaxBounceBytes);
}

}  // namespace
