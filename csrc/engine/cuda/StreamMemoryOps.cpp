#include "engine/cuda/StreamMemoryOps.h"

#include <mutex>
#include <vector>

#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {
namespace {

CUdeviceptr address(void* word) { return reinterpret_cast<CUdeviceptr>(word); }

// CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, read once per device.
bool canFlushRemoteWrites(int device) {
  static std::mutex mutex;
  static std::vector<int> known;  // -1 unknown, else the attribute
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(known.size())) {
    known.resize(device + 1, -1);
  }
  if (known[device] < 0) {
    CUdevice handle = 0;
    check(driver().cuDeviceGet(&handle, device), "cuDeviceGet");
    int value = 0;
    check(driver().cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES,
                                        handle),
          "cuDeviceGetAttribute(CAN_FLUSH_REMOTE_WRITES)");
    known[device] = value;
  }
  return known[device] != 0;
}

void wait(CUstream stream, void* word, uint32_t value, unsigned flags, const char* what) {
  check(driver().cuStreamWaitValue32(stream, address(word), value,
                                     CU_STREAM_WAIT_VALUE_GEQ | flags),
        what);
}

}  // namespace

void waitAtLeast(CUstream stream, void* word, uint32_t value, const char* what) {
  wait(stream, word, value, 0, what);
}

void waitForRemoteWrites(CUstream stream, int device, void* word, uint32_t value,
                         const char* what) {
  wait(stream, word, value, canFlushRemoteWrites(device) ? CU_STREAM_WAIT_VALUE_FLUSH : 0, what);
}

void writeWord(CUstream stream, void* word, uint32_t value, const char* what) {
  check(driver().cuStreamWriteValue32(stream, address(word), value,
                                      CU_STREAM_WRITE_VALUE_DEFAULT),
        what);
}

void runInOrder(CUstream stream, std::initializer_list<WordOp> ops, const char* what) {
  std::vector<CUstreamBatchMemOpParams> params(ops.size());
  auto param = params.begin();
  for (const WordOp& op : ops) {
    *param = {};
    if (op.kind == WordOp::kWaitEquals) {
      param->waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      param->waitValue.address = address(op.word);
      param->waitValue.value = op.value;
      param->waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
    } else {
      param->writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      param->writeValue.address = address(op.word);
      param->writeValue.value = op.value;
      param->writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    ++param;
  }
  check(driver().cuStreamBatchMemOp(stream, static_cast<unsigned>(params.size()), params.data(), 0),
        what);
}

}  // namespace smfree::engine::cuda
