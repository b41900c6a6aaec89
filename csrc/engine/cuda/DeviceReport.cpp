#include "engine/cuda/DeviceReport.h"

#include "engine/cuda/CudaDriver.h"

namespace smfree::engine::cuda {
namespace {

const std::pair<const char*, CUdevice_attribute> kAttributes[] = {
    {"unified addressing", CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING},
    {"copy engines", CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT},
    {"host memory registration", CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED},
    {"64-bit stream memory ops", CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS},
    {"stream wait NOR", CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR},
    {"flush remote writes", CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES},
    {"IPC events", CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED},
    {"POSIX-FD memory handles", CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED},
};

}  // namespace

std::vector<DeviceReport> deviceReports() {
  const Driver& d = driver();
  int count = 0;
  check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
  std::vector<CUdevice> devices(count);
  for (int i = 0; i < count; ++i) check(d.cuDeviceGet(&devices[i], i), "cuDeviceGet");
  std::vector<DeviceReport> reports;
  for (int i = 0; i < count; ++i) {
    DeviceReport report;
    report.index = i;
    char name[256] = {};
    check(d.cuDeviceGetName(name, sizeof(name) - 1, devices[i]), "cuDeviceGetName");
    report.name = name;
    for (const auto& [label, attribute] : kAttributes) {
      int value = 0;
      check(d.cuDeviceGetAttribute(&value, attribute, devices[i]), "cuDeviceGetAttribute");
      report.attributes.emplace_back(label, value);
    }
    for (int j = 0; j < count; ++j) {
      int canAccess = 0;
      if (i != j) {
        check(d.cuDeviceCanAccessPeer(&canAccess, devices[i], devices[j]), "cuDeviceCanAccessPeer");
      }
      report.peerAccess.push_back(canAccess);
    }
    reports.push_back(std::move(report));
  }
  return reports;
}

}  // namespace smfree::engine::cuda
