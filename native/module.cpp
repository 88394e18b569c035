// Python bindings: the thin layer over the engine. Every blocking call releases the GIL.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <system_error>

#include "engine.h"
#include "pages.h"

namespace py = pybind11;
using namespace tieroffload;

namespace {

// Wraps a Python callable so that it can run in an I/O thread: takes the GIL to call it and to
// drop its reference, and reports (never raises) what it throws.
std::function<void()> gil_callback(py::function fn) {
  PyObject* raw = fn.release().ptr();
  return [raw] {
    py::gil_scoped_acquire gil;
    if (PyObject* r = PyObject_CallNoArgs(raw)) {
      Py_DECREF(r);
    } else {
      PyErr_WriteUnraisable(raw);
    }
    Py_DECREF(raw);
  };
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "tieroffload's native async I/O engine (no PyTorch inside).";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      py::object err = py::module_::import("builtins").attr("OSError")(e.code().value(), e.what());
      PyErr_SetObject(PyExc_OSError, err.ptr());
    }
  });

  py::class_<Request, std::shared_ptr<Request>>(m, "Request")
      .def("done", &Request::done)
      .def("wait", &Request::wait, py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("bytes", &Request::bytes)
      .def_property_readonly("error", &Request::error)
      .def_property_readonly("error_offset", &Request::error_offset)
      .def("on_done", [](Request& r, py::function fn) { r.on_done(gil_callback(std::move(fn))); });

  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::string&, int, uint64_t, int, uint64_t>(), py::arg("backend"),
           py::arg("queue_depth"), py::arg("block_size"), py::arg("threads"),
           py::arg("short_cap") = 0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("backend", &Engine::backend)
      .def_property_readonly("closed", &Engine::closed)
      .def("submit", &Engine::submit, py::arg("fd"), py::arg("addr"), py::arg("nbytes"),
           py::arg("offset"), py::arg("write"), py::arg("direct"), py::arg("align"),
           py::call_guard<py::gil_scoped_release>())
      .def("hurry", &Engine::hurry, py::arg("request"),
           "Runs the request's waiting pieces before every other waiting piece.",
           py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());

  py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def(
          "set_on_free",
          [](AlignedBuffer& b, py::function fn) { b.on_free = [fn] { fn(); }; },
          "Calls fn just before the memory is unmapped (the buffer is freed with the GIL held).")
      .def_property_readonly("address",
                             [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def("__len__", &AlignedBuffer::size)
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {b.size()}, {1});
      });

  m.def("discard", &discard_pages, py::arg("addr"), py::arg("nbytes"),
        "Gives the pages of [addr, addr+nbytes) back to the OS (page aligned); they read as zeros.");
  m.def("renew", &renew_pages, py::arg("addr"), py::arg("nbytes"),
        "Maps [addr, addr+nbytes) afresh as one mapping (page aligned); it reads as zeros.");
  m.def("park", &park_pages, py::arg("addr"), py::arg("nbytes"),
        "Moves the pages of [addr, addr+nbytes) to a new range and returns its address (the old\n"
        "range reads as zeros), or -errno where the kernel refuses.");
  m.def("place", &place_pages, py::arg("src"), py::arg("dst"), py::arg("nbytes"),
        "Moves the pages of a parked range [src, src+nbytes) over [dst, dst+nbytes); src is unmapped.");
  m.def("unmap", &unmap_pages, py::arg("addr"), py::arg("nbytes"),
        "Unmaps a parked range: its pages go to the OS.");
  m.def("uring_compiled", &uring_compiled, "True when built with liburing.");
  m.def("uring_probe", &uring_probe,
        "0 when an io_uring ring can be created here, else the errno that refused it.");
  m.def("dio_alignment", &dio_alignment, py::arg("fd"),
        "(memory alignment, offset and size alignment) that O_DIRECT needs on this file.");
}
