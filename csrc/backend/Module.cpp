#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/SmFreeBackend.h"
#include "engine/Engine.h"

namespace {

c10::intrusive_ptr<smfree::SmFreeBackend> createBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& groupName,
    smfree::SmFreeBackend::InnerFactory innerFactory) {
  return c10::make_intrusive<smfree::SmFreeBackend>(store, rank, size, timeout, groupName,
                                                    std::move(innerFactory));
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
           "Engine-wide counters: live_ops, ipc_mappings, flag_words_in_use.");

  module.def("_stop_engine", &smfree::engine::Engine::stopProcessEngine,
             py::call_guard<py::gil_scoped_release>(),
             "Stops the process's engine (at exit), failing its pending ops.");
}
