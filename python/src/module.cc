// The extension module `eplb._eplb`: the exception tree, array conversions, and the module.

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <exception>
#include <memory>
#include <string>

#include "bindings.h"
#include "eplb/core/error.h"

namespace eplb::python {
namespace {

// The Python side of eplb's exception tree. InvalidArgument is also a ValueError, so callers
// that treat bad arguments the Python way (except ValueError) keep working. Created once per
// process with the module and never freed: the translator may run until interpreter exit.
struct ErrorTypes {
  PyObject* error = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* not_supported = nullptr;
  PyObject* io_error = nullptr;
  PyObject* timeout = nullptr;
};
ErrorTypes errors;

PyObject* new_error(py::module_& m, const char* name, const char* doc, PyObject* bases) {
  const std::string qualified = std::string("eplb.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.attr(name) = py::handle(type);  // the module holds its own reference
  return type;
}

}  // namespace

void bind_errors(py::module_& m) {
  errors.error = new_error(m, "Error", "Base of every error eplb raises.", PyExc_Exception);
  const py::tuple invalid_bases =
      py::make_tuple(py::handle(errors.error), py::handle(PyExc_ValueError));
  errors.invalid_argument = new_error(
      m, "InvalidArgument",
      "Bad input or configuration; the message names the value and the rule. Also a ValueError.",
      invalid_bases.ptr());
  errors.not_supported =
      new_error(m, "NotSupported", "A backend lacks a capability.", errors.error);
  errors.io_error = new_error(
      m, "IoError", "A file, peer or link failed; the caller may retry or rebuild.", errors.error);
  errors.timeout =
      new_error(m, "Timeout", "An operation did not finish within its deadline.", errors.error);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(errors.invalid_argument, e.what());
    } catch (const NotSupported& e) {
      PyErr_SetString(errors.not_supported, e.what());
    } catch (const IoError& e) {
      PyErr_SetString(errors.io_error, e.what());
    } catch (const Timeout& e) {
      PyErr_SetString(errors.timeout, e.what());
    } catch (const Error& e) {
      PyErr_SetString(errors.error, e.what());
    }
  });
}

LoadMatrix to_load(const LoadArray& weight) {
  if (weight.ndim() != 2) {
    fail("weight must be a 2-D [layers, experts] array, got ", weight.ndim(), " dimensions");
  }
  LoadMatrix load(weight.shape(0), weight.shape(1));
  const double* data = weight.data();
  load.values.assign(data, data + weight.size());
  return load;
}

Placement to_placement(const IndexArray& phy2log, int64_t experts, const std::string& what,
                       bool complete) {
  if (phy2log.ndim() != 2) {
    fail(what, " must be a 2-D [layers, physical] array, got ", phy2log.ndim(), " dimensions");
  }
  const int64_t layers = phy2log.shape(0);
  const int64_t physical = phy2log.shape(1);
  // Checked before anything is sized by them.
  if (experts < 1 || experts > kMaxExperts) {
    fail(what, ": ", experts, " experts per layer is outside [1, ", kMaxExperts, "]");
  }
  if (layers > kMaxLayers || physical > kMaxPhysical) {
    fail(what, " has shape [", layers, ", ", physical, "]; eplb supports at most ", kMaxLayers,
         " layers and ", kMaxPhysical, " physical slots per layer");
  }
  Placement out(layers, experts, physical);
  const int64_t* data = phy2log.data();
  for (int64_t i = 0; i < layers * physical; ++i) {
    if (data[i] < 0 || data[i] >= experts) {
      fail(what, "[", i / physical, "][", i % physical, "] is expert ", data[i], ", outside [0, ",
           experts, ")");
    }
    out.phy2log[i] = static_cast<int32_t>(data[i]);
  }
  out.derive_from_phy2log();
  if (complete) {
    try {
      out.validate();
    } catch (const InvalidArgument& e) {
      fail(what, ": ", e.what());
    }
  }
  return out;
}

py::array_t<int64_t> to_numpy(const int32_t* values, std::initializer_list<py::ssize_t> shape) {
  py::array_t<int64_t> out(shape);
  int64_t* data = out.mutable_data();
  const py::ssize_t n = out.size();
  for (py::ssize_t i = 0; i < n; ++i) data[i] = values[i];
  return out;
}

// The cost model's bindings (cost.cc).
void bind_cost(py::module_& m);

// The runtime's logs (rebalances, the watchdog) go to standard error, as the CLI's do: standard
// output is the engine's, and an engine or example that prints one JSON document there must
// find nothing else in it. spdlog's default logger writes to standard output.
void log_to_stderr() {
  auto logger = std::make_shared<spdlog::logger>(
      "", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(spdlog::default_logger()->level());
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace eplb::python

PYBIND11_MODULE(_eplb, m) {
  m.doc() = "C++ core of the eplb package; use the functions of `eplb` instead.";
  eplb::python::log_to_stderr();
  m.attr("__version__") = EPLB_VERSION;
  eplb::python::bind_errors(m);
  eplb::python::bind_placement(m);
  eplb::python::bind_migration(m);
  eplb::python::bind_runtime(m);
  eplb::python::bind_transport(m);
  eplb::python::bind_cost(m);
}
