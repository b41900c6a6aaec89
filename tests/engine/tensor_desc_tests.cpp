// Tensor descriptors: what a matched send and recv must agree on.

#include "engine/TensorDesc.h"

#include "check.h"

using namespace smfree::engine;

namespace {

TEST(descriptorsCompareBytesDtypeAndDevice, "descriptors compare bytes, dtype and device") {
  TensorDesc a{16, "float32", "cpu", {4}};
  TensorDesc flat{16, "float32", "cpu", {2, 2}};
  TensorDesc other{16, "int32", "cpu", {4}};
  TensorDesc gpu{16, "float32", "cuda", {4}};
  CHECK(a.compatibleWith(flat));
  CHECK(!a.compatibleWith(other));
  CHECK(!a.compatibleWith(gpu));
  CHECK(a.describe() == "float32[4] (16 B)");
  CHECK(gpu.describe() == "float32[4] (16 B) on cuda");
}

}  // namespace
