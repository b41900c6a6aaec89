// Probe: does a stream parked on a host flag (cuStreamWaitValue32) hold up a copy
// submitted later on another stream? Variants place the copying stream differently:
//   same       a new stream of the primary context
//   high       a new stream of the greatest priority (high-priority user streams left free)
//   userwrite  no copy, only a flag write on a new stream
//   ctx        a stream of a second context on the same device, copying primary-context memory
//   ctxown     the same, copying memory of the second context
//   peerctx    a stream of a context on GPU 1, copying GPU 0's memory into its own
// Build and run on a GPU machine (docs/design.md quotes its output):
//   g++ -std=c++17 -O1 -I/usr/local/cuda/include tools/probe_stream_queues.cpp -o /tmp/probe \
//       $(ldconfig -p | grep 'libcuda.so.1 ' | head -1 | awk '{print $NF}')
//   for v in same high userwrite ctx ctxown peerctx; do
//     CUDA_DEVICE_MAX_CONNECTIONS=1 /tmp/probe $v; /tmp/probe $v; CUDA_DEVICE_MAX_CONNECTIONS=32 /tmp/probe $v
//   done
#include <cuda.h>
#include <dlfcn.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s_ = nullptr; cuGetErrorString(r_, &s_); printf("  %s -> %d %s\n", #x, (int)r_, s_ ? s_ : "?"); } } while (0)

static volatile unsigned* flags;

static bool pollFor(int index, unsigned value, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (flags[index] >= value) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return false;
}

int main(int argc, char** argv) {
  std::string variant = argv[1];
  const char* conns = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  CK(cuInit(0));
  CUdevice dev0, dev1; CK(cuDeviceGet(&dev0, 0));
  int count = 0; cuDeviceGetCount(&count);
  CUcontext primary; CK(cuDevicePrimaryCtxRetain(&primary, dev0)); CK(cuCtxSetCurrent(primary));
  void* host = nullptr;
  CK(cuMemHostAlloc(&host, 4096, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  memset(host, 0, 4096); flags = (volatile unsigned*)host;
  CUdeviceptr hostDev = (CUdeviceptr)host;
  const size_t bytes = 64 << 20;
  CUdeviceptr src, dst; CK(cuMemAlloc(&src, bytes)); CK(cuMemAlloc(&dst, bytes));
  CK(cuMemsetD32(src, 0xabcd1234u, bytes / 4)); CK(cuMemsetD32(dst, 0, bytes / 4));
  int least, greatest; CK(cuCtxGetStreamPriorityRange(&least, &greatest));
  // Streams torch would have: the legacy default stream, pool streams of both priorities.
  std::vector<CUstream> users;
  users.push_back(CU_STREAM_LEGACY);
  for (int i = 0; i < 16; ++i) { CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); users.push_back(s); }
  for (int i = 0; i < 4; ++i) { CUstream s; CK(cuStreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, greatest)); users.push_back(s); }
  bool parkHigh = variant != "high";  // "high" leaves the high-priority user streams free
  for (size_t i = 0; i < users.size(); ++i) {
    if (i >= 17 && !parkHigh) continue;
    CK(cuStreamWaitValue32(users[i], hostDev, 1, CU_STREAM_WAIT_VALUE_GEQ));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CUcontext other = nullptr;
  CUstream dma = nullptr;
  CUdeviceptr target = dst;
  if (variant == "same") {
    CK(cuStreamCreate(&dma, CU_STREAM_NON_BLOCKING));
  } else if (variant == "high") {
    CK(cuStreamCreateWithPriority(&dma, CU_STREAM_NON_BLOCKING, greatest));
  } else if (variant == "userwrite") {
    CK(cuStreamCreate(&dma, CU_STREAM_NON_BLOCKING));  // a fresh user stream: no copy, just the write
  } else if (variant == "ctx" || variant == "ctxown") {
    CUctxCreateParams params{}; CK(cuCtxCreate(&other, &params, 0, dev0));  // becomes current
    CK(cuStreamCreate(&dma, CU_STREAM_NON_BLOCKING));
    if (variant == "ctxown") { CK(cuMemAlloc(&src, bytes)); CK(cuMemAlloc(&target, bytes)); CK(cuMemsetD32(src, 0xabcd1234u, bytes / 4)); }
  } else if (variant == "peerctx") {
    if (count < 2) { printf("peerctx needs 2 GPUs\n"); return 0; }
    CK(cuDeviceGet(&dev1, 1));
    CUctxCreateParams params{}; CK(cuCtxCreate(&other, &params, 0, dev1));
    size_t freeMem, total; CK(cuMemGetInfo(&freeMem, &total));
    printf("  device 1 in use after creating our context there: %.0f MiB\n", (total - freeMem) / 1048576.0);
    CK(cuCtxEnablePeerAccess(primary, 0));
    CK(cuMemAlloc(&target, bytes));
    CK(cuStreamCreate(&dma, CU_STREAM_NON_BLOCKING));
  }
  auto t0 = std::chrono::steady_clock::now();
  if (variant != "userwrite") CK(cuMemcpyAsync(target, src, bytes, dma));
  CK(cuStreamWriteValue32(dma, hostDev + 4, 1, CU_STREAM_WRITE_VALUE_DEFAULT));
  bool ran = pollFor(1, 1, 2.0);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  flags[0] = 1;
  bool later = pollFor(1, 1, 5.0);
  if (other) { CK(cuCtxSynchronize()); }
  CK(cuCtxSetCurrent(primary)); CK(cuCtxSynchronize());
  unsigned first = 0;
  if (variant != "userwrite") {
    if (other) CK(cuCtxSetCurrent(other));
    CK(cuMemcpyDtoH(&first, target + bytes - 4, 4));
  }
  printf("CONNECTIONS=%s variant=%-9s copy+write with %zu user streams parked: %s (%.1f ms); after release: %s; data %s\n",
         conns ? conns : "default", variant.c_str(), users.size() - (parkHigh ? 0 : 4),
         ran ? "RAN" : "BLOCKED", ms, later ? "ran" : "never", variant == "userwrite" ? "-" : (first == 0xabcd1234u ? "ok" : "WRONG"));
  return 0;
}
