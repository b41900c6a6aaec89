#include "engine/cuda/Capture.h"

#include <memory>

#include "engine/Error.h"
#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {
namespace {

struct OnDestroy {
  std::function<void()> run;
  bool armed = true;  // false: the graph never took it
};

void runOnDestroy(void* closure) {
  std::unique_ptr<OnDestroy> onDestroy(static_cast<OnDestroy*>(closure));
  if (!onDestroy->armed) return;
  // No exception may leave a driver callback.
  try {
    onDestroy->run();
  } catch (...) {
  }
}

}  // namespace

std::optional<Capture> captureOf(CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  Capture capture;
  const CUresult result = driver().cuStreamGetCaptureInfo(stream, &status, &capture.id,
                                                          &capture.graph, nullptr, nullptr,
                                                          nullptr);
  if (result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
    fail("the current stream is the legacy default stream while another stream captures a CUDA "
         "graph: work queued on it would join that capture; use a stream of its own "
         "(torch.cuda.stream)");
  }
  check(result, "cuStreamGetCaptureInfo");
  switch (status) {
    case CU_STREAM_CAPTURE_STATUS_NONE:
      return std::nullopt;
    case CU_STREAM_CAPTURE_STATUS_ACTIVE:
      return capture;
    case CU_STREAM_CAPTURE_STATUS_INVALIDATED:
      break;
  }
  fail("the current stream's CUDA graph capture was invalidated by an earlier error; end it "
       "and capture again");
}

void onGraphDestroyed(CUgraph graph, std::function<void()> onDestroy) {
  auto closure = std::make_unique<OnDestroy>(OnDestroy{std::move(onDestroy)});
  CUuserObject object = nullptr;
  check(driver().cuUserObjectCreate(&object, closure.get(), runOnDestroy, 1,
                                    CU_USER_OBJECT_NO_DESTRUCTOR_SYNC),
        "cuUserObjectCreate");
  OnDestroy* owned = closure.release();  // the object frees it with its last reference
  const CUresult retained =
      driver().cuGraphRetainUserObject(graph, object, 1, CU_GRAPH_USER_OBJECT_MOVE);
  if (retained != CUDA_SUCCESS) {
    owned->armed = false;
    driver().cuUserObjectRelease(object, 1);  // ours was the only reference
    fail("CUDA cuGraphRetainUserObject failed: ", errorText(retained));
  }
}

}  // namespace smfree::engine::cuda
