#pragma once
// Shared by the translation units of the extension module `eplb._eplb`. The module is the thin
// layer under the pure-Python package `eplb`: it takes arrays the package has already converted
// (C-contiguous float64 loads, int64 phy2log), runs the C++ library with the GIL released, and
// returns numpy arrays and dicts. Argument checks with user-facing messages live in the C++
// library (eplb::InvalidArgument -> eplb.InvalidArgument, a ValueError).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "eplb/core/types.h"

namespace eplb::python {

namespace py = pybind11;

using LoadArray = py::array_t<double, py::array::c_style | py::array::forcecast>;    // [L][E]
using IndexArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;  // [L][P]

// Copies a [layers][experts] array into a LoadMatrix (validated later, by the library).
LoadMatrix to_load(const LoadArray& weight);

// Builds a placement of `experts` experts from a [layers][physical] phy2log array, replicas in
// slot order. `what` names the argument in messages ("previous", "old_phy2log", ...). Throws
// InvalidArgument for a wrong shape, an expert outside [0, experts), or (when `complete`) an
// expert without a slot.
Placement to_placement(const IndexArray& phy2log, int64_t experts, const std::string& what,
                       bool complete);

// An int64 numpy array of the given shape, filled from int32 values.
py::array_t<int64_t> to_numpy(const int32_t* values, std::initializer_list<py::ssize_t> shape);

void bind_errors(py::module_& m);
void bind_placement(py::module_& m);
void bind_migration(py::module_& m);
void bind_runtime(py::module_& m);
void bind_transport(py::module_& m);

}  // namespace eplb::python
