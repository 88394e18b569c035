// Python bindings: the thin layer over the engine. Every blocking call releases the GIL.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>

#include <cerrno>
#include <system_error>

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux 5.7; older glibc headers lack the name
#endif

#include "engine.h"

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

  m.def(
      "discard",
      [](uintptr_t addr, size_t nbytes) {
        if (madvise(reinterpret_cast<void*>(addr), nbytes, MADV_DONTNEED) != 0)
          throw std::system_error(errno, std::generic_category(), "madvise");
      },
      py::arg("addr"), py::arg("nbytes"),
      "Gives the pages of [addr, addr+nbytes) back to the OS (page aligned); they read as zeros.");
  m.def(
      "renew",
      [](uintptr_t addr, size_t nbytes) {
        if (mmap(reinterpret_cast<void*>(addr), nbytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
          throw std::system_error(errno, std::generic_category(), "mmap");
        advise_huge(reinterpret_cast<void*>(addr), nbytes);  // a new mapping loses the advice
      },
      py::arg("addr"), py::arg("nbytes"),
      "Maps [addr, addr+nbytes) afresh as one mapping (page aligned), whatever mappings moves\n"
      "split it into; it reads as zeros.");
  m.def(
      "park",
      [](uintptr_t addr, size_t nbytes) -> int64_t {
        void* p = mremap(reinterpret_cast<void*>(addr), nbytes, nbytes,
                         MREMAP_MAYMOVE | MREMAP_DONTUNMAP, nullptr);
        return p == MAP_FAILED ? -errno : static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
      },
      py::arg("addr"), py::arg("nbytes"),
      "Moves the pages of [addr, addr+nbytes) to a new range and returns its address; the old\n"
      "range stays mapped and reads as zeros, as after discard. -errno where the kernel refuses\n"
      "(EINVAL before Linux 5.7, EFAULT for a range over two mappings).");
  m.def(
      "place",
      [](uintptr_t src, uintptr_t dst, size_t nbytes) {
        if (mremap(reinterpret_cast<void*>(src), nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED,
                   reinterpret_cast<void*>(dst)) == MAP_FAILED)
          throw std::system_error(errno, std::generic_category(), "mremap");
      },
      py::arg("src"), py::arg("dst"), py::arg("nbytes"),
      "Moves the pages of [src, src+nbytes) (a parked range) over [dst, dst+nbytes): no page\n"
      "is zeroed or copied; src is unmapped.");
  m.def(
      "unmap",
      [](uintptr_t addr, size_t nbytes) {
        if (munmap(reinterpret_cast<void*>(addr), nbytes) != 0)
          throw std::system_error(errno, std::generic_category(), "munmap");
      },
      py::arg("addr"), py::arg("nbytes"), "Unmaps a parked range: its pages go to the OS.");
  m.def("uring_compiled", &uring_compiled, "True when built with liburing.");
  m.def("uring_probe", &uring_probe,
        "0 when an io_uring ring can be created here, else the errno that refused it.");
  m.def("dio_alignment", &dio_alignment, py::arg("fd"),
        "(memory alignment, offset and size alignment) that O_DIRECT needs on this file.");
}
