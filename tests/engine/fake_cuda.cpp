#include "fake_cuda.h"

#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "engine/Error.h"

namespace smfree::engine::testing {
namespace {

struct Stream {
  std::deque<std::function<bool()>> ops;  // each: false while what it waits for does not hold
};

struct Event {
  uint64_t recorded = 0;  // records queued
  uint64_t reached = 0;   // records run
};

struct State {
  std::vector<std::unique_ptr<Stream>> streams;  // destroyed streams run on, as on a GPU
  std::vector<std::unique_ptr<Event>> events;
  std::map<CUdeviceptr, size_t> allocations;  // cuMemAlloc'd: base, size
  std::map<std::string, CUresult> failNext;
  std::map<std::string, size_t> calls;
  CUresult deviceFailure = CUDA_SUCCESS;
};

State* state = nullptr;

// Counts the call, runs what can run, and returns an injected failure if one is due.
CUresult enter(const char* function) {
  if (!state) fail("the fake CUDA driver was called outside a FakeCuda's scope");
  ++state->calls[function];
  const auto it = state->failNext.find(function);
  if (it == state->failNext.end()) return CUDA_SUCCESS;
  const CUresult result = it->second;
  state->failNext.erase(it);
  return result;
}

size_t runAll() {
  size_t ran = 0;
  for (bool moved = true; moved;) {
    moved = false;
    for (const auto& stream : state->streams) {
      while (!stream->ops.empty() && stream->ops.front()()) {
        stream->ops.pop_front();
        ++ran;
        moved = true;
      }
    }
  }
  return ran;
}

CUresult queue(CUstream handle, std::function<bool()> op) {
  if (!handle) return CUDA_ERROR_INVALID_HANDLE;  // the tests use streams of their own
  reinterpret_cast<Stream*>(handle)->ops.push_back(std::move(op));
  runAll();
  return CUDA_SUCCESS;
}

volatile uint32_t* wordAt(CUdeviceptr address) {
  return reinterpret_cast<volatile uint32_t*>(address);
}

bool holds(CUdeviceptr address, uint32_t value, unsigned flags) {
  const uint32_t word = __atomic_load_n(const_cast<uint32_t*>(wordAt(address)), __ATOMIC_ACQUIRE);
  switch (flags & 0x3) {
    case CU_STREAM_WAIT_VALUE_GEQ:
      return static_cast<int32_t>(word - value) >= 0;
    case CU_STREAM_WAIT_VALUE_EQ:
      return word == value;
    case CU_STREAM_WAIT_VALUE_AND:
      return (word & value) != 0;
    default:  // NOR
      return ~(word | value) != 0;
  }
}

void write(CUdeviceptr address, uint32_t value) {
  __atomic_store_n(const_cast<uint32_t*>(wordAt(address)), value, __ATOMIC_RELEASE);
}

template <typename Function>
struct Unsupported;
template <typename... Args>
struct Unsupported<CUresult (*)(Args...)> {
  static CUresult call(Args...) { return CUDA_ERROR_NOT_SUPPORTED; }
};

template <typename Function>
struct NotCapturing;
template <typename... Rest>
struct NotCapturing<CUresult (*)(CUstream, CUstreamCaptureStatus*, Rest...)> {
  static CUresult call(CUstream, CUstreamCaptureStatus* status, Rest...) {
    if (const CUresult result = enter("cuStreamGetCaptureInfo")) return result;
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
  }
};

CUresult getErrorString(CUresult result, const char** text) {
  static const std::string prefix = "fake CUDA error ";
  static std::map<int, std::string> texts;
  auto [it, created] = texts.try_emplace(result, prefix + std::to_string(result));
  *text = it->second.c_str();
  return CUDA_SUCCESS;
}

CUresult init(unsigned) { return enter("cuInit"); }
CUresult deviceGet(CUdevice* device, int ordinal) {
  *device = ordinal;
  return enter("cuDeviceGet");
}
CUresult deviceGetCount(int* count) {
  *count = 2;
  return enter("cuDeviceGetCount");
}
CUresult deviceGetAttribute(int* value, CUdevice_attribute, CUdevice) {
  *value = 0;
  return enter("cuDeviceGetAttribute");
}
CUresult deviceCanAccessPeer(int* can, CUdevice, CUdevice) {
  *can = 1;
  return enter("cuDeviceCanAccessPeer");
}
CUresult primaryCtxRetain(CUcontext* context, CUdevice device) {
  *context = reinterpret_cast<CUcontext>(static_cast<uintptr_t>(device) + 1);
  return enter("cuDevicePrimaryCtxRetain");
}
CUresult ctxPush(CUcontext) { return enter("cuCtxPushCurrent"); }
CUresult ctxPop(CUcontext* context) {
  *context = nullptr;
  return enter("cuCtxPopCurrent");
}
CUresult ctxEnablePeerAccess(CUcontext, unsigned) { return enter("cuCtxEnablePeerAccess"); }
CUresult exchangeCaptureMode(CUstreamCaptureMode*) {
  return enter("cuThreadExchangeStreamCaptureMode");
}

CUresult streamCreate(CUstream* stream, unsigned) {
  if (const CUresult result = enter("cuStreamCreate")) return result;
  state->streams.push_back(std::make_unique<Stream>());
  *stream = reinterpret_cast<CUstream>(state->streams.back().get());
  return CUDA_SUCCESS;
}
CUresult streamDestroy(CUstream) { return enter("cuStreamDestroy"); }
CUresult streamSynchronize(CUstream stream) {
  if (const CUresult result = enter("cuStreamSynchronize")) return result;
  runAll();
  // A real stream would block for ever here.
  return reinterpret_cast<Stream*>(stream)->ops.empty() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUresult streamGetId(CUstream stream, unsigned long long* id) {
  *id = reinterpret_cast<uintptr_t>(stream);
  return enter("cuStreamGetId");
}
CUresult waitValue(CUstream stream, CUdeviceptr address, cuuint32_t value, unsigned flags) {
  if (const CUresult result = enter("cuStreamWaitValue32")) return result;
  return queue(stream, [=] { return holds(address, value, flags); });
}
CUresult writeValue(CUstream stream, CUdeviceptr address, cuuint32_t value, unsigned) {
  if (const CUresult result = enter("cuStreamWriteValue32")) return result;
  return queue(stream, [=] {
    write(address, value);
    return true;
  });
}
CUresult batchMemOp(CUstream stream, unsigned count, CUstreamBatchMemOpParams* params,
                    unsigned) {
  if (const CUresult result = enter("cuStreamBatchMemOp")) return result;
  for (unsigned i = 0; i < count; ++i) {
    const CUstreamBatchMemOpParams op = params[i];
    if (op.operation == CU_STREAM_MEM_OP_WAIT_VALUE_32) {
      queue(stream, [op] {
        return holds(op.waitValue.address, op.waitValue.value, op.waitValue.flags);
      });
    } else if (op.operation == CU_STREAM_MEM_OP_WRITE_VALUE_32) {
      queue(stream, [op] {
        write(op.writeValue.address, op.writeValue.value);
        return true;
      });
    } else {
      return CUDA_ERROR_NOT_SUPPORTED;
    }
  }
  return CUDA_SUCCESS;
}
CUresult memcpyAsync(CUdeviceptr to, CUdeviceptr from, size_t bytes, CUstream stream) {
  if (const CUresult result = enter("cuMemcpyAsync")) return result;
  return queue(stream, [=] {
    std::memcpy(reinterpret_cast<void*>(to), reinterpret_cast<const void*>(from), bytes);
    return true;
  });
}

CUresult eventCreate(CUevent* event, unsigned) {
  if (const CUresult result = enter("cuEventCreate")) return result;
  state->events.push_back(std::make_unique<Event>());
  *event = reinterpret_cast<CUevent>(state->events.back().get());
  return CUDA_SUCCESS;
}
CUresult eventDestroy(CUevent) { return enter("cuEventDestroy"); }
CUresult eventRecord(CUevent handle, CUstream stream) {
  if (const CUresult result = enter("cuEventRecord")) return result;
  Event* event = reinterpret_cast<Event*>(handle);
  const uint64_t record = ++event->recorded;
  return queue(stream, [event, record] {
    event->reached = std::max(event->reached, record);
    return true;
  });
}
CUresult eventQuery(CUevent handle) {
  if (const CUresult result = enter("cuEventQuery")) return result;
  if (state->deviceFailure != CUDA_SUCCESS) return state->deviceFailure;
  const Event* event = reinterpret_cast<Event*>(handle);
  return event->reached >= event->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
CUresult streamWaitEvent(CUstream stream, CUevent handle, unsigned) {
  if (const CUresult result = enter("cuStreamWaitEvent")) return result;
  const Event* event = reinterpret_cast<Event*>(handle);
  const uint64_t record = event->recorded;  // the last record, as submitted now
  return queue(stream, [event, record] { return event->reached >= record; });
}

CUresult memAlloc(CUdeviceptr* pointer, size_t bytes) {
  if (const CUresult result = enter("cuMemAlloc")) return result;
  *pointer = reinterpret_cast<CUdeviceptr>(std::calloc(1, bytes ? bytes : 1));
  state->allocations[*pointer] = bytes;
  return CUDA_SUCCESS;
}
CUresult memFree(CUdeviceptr pointer) {
  if (const CUresult result = enter("cuMemFree")) return result;
  state->allocations.erase(pointer);
  std::free(reinterpret_cast<void*>(pointer));
  return CUDA_SUCCESS;
}
// The cuMemAlloc'd allocation holding `address`.
const std::pair<const CUdeviceptr, size_t>* allocationOf(CUdeviceptr address) {
  auto it = state->allocations.upper_bound(address);
  if (it == state->allocations.begin()) return nullptr;
  --it;
  return address < it->first + std::max<size_t>(it->second, 1) ? &*it : nullptr;
}
CUresult memGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr address) {
  if (const CUresult result = enter("cuMemGetAddressRange")) return result;
  const auto* allocation = allocationOf(address);
  if (!allocation) return CUDA_ERROR_NOT_FOUND;
  *base = allocation->first;
  *size = allocation->second;
  return CUDA_SUCCESS;
}
CUresult memHostAlloc(void** pointer, size_t bytes, unsigned) {
  if (const CUresult result = enter("cuMemHostAlloc")) return result;
  *pointer = std::calloc(1, bytes ? bytes : 1);
  return CUDA_SUCCESS;
}
CUresult memFreeHost(void* pointer) {
  std::free(pointer);
  return enter("cuMemFreeHost");
}
CUresult memHostRegister(void*, size_t, unsigned) { return enter("cuMemHostRegister"); }
// An IPC handle carries the address: in one process it maps to itself.
CUresult ipcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr address) {
  if (const CUresult result = enter("cuIpcGetMemHandle")) return result;
  *handle = {};
  std::memcpy(handle->reserved, &address, sizeof(address));
  return CUDA_SUCCESS;
}
CUresult ipcOpenMemHandle(CUdeviceptr* address, CUipcMemHandle handle, unsigned) {
  if (const CUresult result = enter("cuIpcOpenMemHandle")) return result;
  std::memcpy(address, handle.reserved, sizeof(*address));
  return CUDA_SUCCESS;
}
CUresult ipcCloseMemHandle(CUdeviceptr) { return enter("cuIpcCloseMemHandle"); }
// What exports ask of cuMemAlloc'd memory: it can go by an IPC handle, and its id (its base).
CUresult pointerGetAttribute(void* value, CUpointer_attribute which, CUdeviceptr address) {
  if (const CUresult result = enter("cuPointerGetAttribute")) return result;
  const auto* allocation = allocationOf(address);
  if (!allocation) return CUDA_ERROR_INVALID_VALUE;
  uint64_t answer = 0;
  if (which == CU_POINTER_ATTRIBUTE_BUFFER_ID) {
    answer = allocation->first;
  } else if (which == CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) {
    answer = 1;
  } else {
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  std::memcpy(value, &answer, which == CU_POINTER_ATTRIBUTE_BUFFER_ID ? 8 : sizeof(int));
  return CUDA_SUCCESS;
}
CUresult memHostUnregister(void*) { return enter("cuMemHostUnregister"); }

cuda::Driver fakeTable() {
  cuda::Driver table;
#define SMFREE_FAKE_UNSUPPORTED(name) table.name = &Unsupported<decltype(&::name)>::call;
  SMFREE_CUDA_FUNCTIONS(SMFREE_FAKE_UNSUPPORTED)
#undef SMFREE_FAKE_UNSUPPORTED
  table.cuGetErrorString = &getErrorString;
  table.cuInit = &init;
  table.cuDeviceGet = &deviceGet;
  table.cuDeviceGetCount = &deviceGetCount;
  table.cuDeviceGetAttribute = &deviceGetAttribute;
  table.cuDeviceCanAccessPeer = &deviceCanAccessPeer;
  table.cuDevicePrimaryCtxRetain = &primaryCtxRetain;
  table.cuCtxPushCurrent = &ctxPush;
  table.cuCtxPopCurrent = &ctxPop;
  table.cuCtxEnablePeerAccess = &ctxEnablePeerAccess;
  table.cuThreadExchangeStreamCaptureMode = &exchangeCaptureMode;
  table.cuStreamGetCaptureInfo = &NotCapturing<decltype(&::cuStreamGetCaptureInfo)>::call;
  table.cuStreamCreate = &streamCreate;
  table.cuStreamDestroy = &streamDestroy;
  table.cuStreamSynchronize = &streamSynchronize;
  table.cuStreamGetId = &streamGetId;
  table.cuStreamWaitValue32 = &waitValue;
  table.cuStreamWriteValue32 = &writeValue;
  table.cuStreamBatchMemOp = &batchMemOp;
  table.cuMemcpyAsync = &memcpyAsync;
  table.cuEventCreate = &eventCreate;
  table.cuEventDestroy = &eventDestroy;
  table.cuEventRecord = &eventRecord;
  table.cuEventQuery = &eventQuery;
  table.cuStreamWaitEvent = &streamWaitEvent;
  table.cuMemAlloc = &memAlloc;
  table.cuMemFree = &memFree;
  table.cuMemHostAlloc = &memHostAlloc;
  table.cuMemFreeHost = &memFreeHost;
  table.cuMemHostRegister = &memHostRegister;
  table.cuMemHostUnregister = &memHostUnregister;
  table.cuIpcGetMemHandle = &ipcGetMemHandle;
  table.cuPointerGetAttribute = &pointerGetAttribute;
  table.cuIpcOpenMemHandle = &ipcOpenMemHandle;
  table.cuIpcCloseMemHandle = &ipcCloseMemHandle;
  table.cuMemGetAddressRange = &memGetAddressRange;
  return table;
}

const cuda::Driver& fakeDriver() {
  static const cuda::Driver table = fakeTable();
  return table;
}

State& installState() {
  if (state) fail("a FakeCuda is already installed");
  state = new State;
  return *state;
}

}  // namespace

FakeCuda::FakeCuda() : override_((installState(), fakeDriver())) {}

FakeCuda::~FakeCuda() {
  delete state;
  state = nullptr;
}

size_t FakeCuda::run() { return runAll(); }

size_t FakeCuda::pending() const {
  size_t queued = 0;
  for (const auto& stream : state->streams) queued += stream->ops.size();
  return queued;
}

void FakeCuda::failNext(const std::string& function, CUresult result) {
  state->failNext[function] = result;
}

void FakeCuda::failDevice(CUresult result) { state->deviceFailure = result; }

size_t FakeCuda::calls(const std::string& function) const {
  const auto it = state->calls.find(function);
  return it == state->calls.end() ? 0 : it->second;
}

}  // namespace smfree::engine::testing
