#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/CallerRelease.h"
#include "backend/SmFreeBackend.h"
#include "engine/Engine.h"
#include "engine/Error.h"
#include "engine/cuda/DeviceReport.h"
#include "engine/transports/ucx/UcxReport.h"

namespace {

c10::intrusive_ptr<smfree::SmFreeBackend> createBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& groupName,
    smfree::SmFreeBackend::InnerFactory innerFactory) {
  return c10::make_intrusive<smfree::SmFreeBackend>(store, rank, size, timeout, groupName,
                                                    std::move(innerFactory));
}

// UCX and GPU facts for `python -m smfree_pg.doctor`; a part that cannot be read says why.
py::dict doctorReport() {
  py::dict report;
  try {
    const auto ucx = smfree::engine::ucxReport();
    report["ucx"] = py::dict(py::arg("version") = ucx.version,
                             py::arg("resources") = ucx.resources,
                             py::arg("tcp_user_timeout") = ucx.tcpUserTimeout);
  } catch (const smfree::engine::Error& error) {
    report["ucx"] = py::dict(py::arg("error") = std::string(error.what()));
  }
  try {
    py::list devices;
    for (const auto& device : smfree::engine::cuda::deviceReports()) {
      py::dict attributes;
      for (const auto& [name, value] : device.attributes) attributes[py::str(name)] = value;
      devices.append(py::dict(py::arg("index") = device.index, py::arg("name") = device.name,
                              py::arg("attributes") = attributes,
                              py::arg("peer_access") = device.peerAccess));
    }
    report["cuda"] = py::dict(py::arg("devices") = devices);
  } catch (const smfree::engine::Error& error) {
    report["cuda"] = py::dict(py::arg("error") = std::string(error.what()));
  }
  return report;
}

}  // namespace

PYBIND11_MODULE(_C, module) {
  module.doc() = "smfree: copy-engine point-to-point backend for torch.distributed";

  py::class_<smfree::SmFreeBackend, c10d::Backend, c10::intrusive_ptr<smfree::SmFreeBackend>>(
      module, "SmFreeBackend")
      .def(py::init(&createBackend), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout"), py::arg("group_name"), py::arg("inner_factory"),
           py::call_guard<py::gil_scoped_release>())
      .def("dump_pending", &smfree::SmFreeBackend::dumpPending,
           py::call_guard<py::gil_scoped_release>())
      .def("_stats", &smfree::SmFreeBackend::stats, py::call_guard<py::gil_scoped_release>(),
           "Engine-wide counters (live_ops, ipc_mappings, ipc_exports, flag_words_in_use, ...) and "
           "the group's collectives_on_copy_engines.");

  module.def("_doctor", &doctorReport, "UCX and GPU facts for smfree_pg.doctor.");
  module.def("_collectives_on_copy_engines", &smfree::collectivesOnCopyEngines,
             "The collectives SMFREE_COLLECTIVES runs on the copy engines (on CUDA tensors of "
             "ranks of one host).");
  module.def("_collective_min_bytes", &smfree::collectiveMinBytes,
             "SMFREE_COLLECTIVE_MIN_BYTES: smaller pieces go to NCCL.");

  module.def("_stop_engine", &smfree::engine::Engine::stopProcessEngine,
             py::call_guard<py::gil_scoped_release>(),
             "Stops the process's engine (at exit), failing its pending ops.");
  module.def("_stop_caller_release", &smfree::CallerRelease::stop,
             py::call_guard<py::gil_scoped_release>(),
             "Ends the thread that drops the Works ended ops hand back (at exit, after the engine).");
}
