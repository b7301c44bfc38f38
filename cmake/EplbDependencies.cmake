# Optional backends. Each EPLB_WITH_X that is ON must find its dependency or stop here with a
# message naming the Debian package; AUTO builds it where its dependency is found and says so
# (what `pip install .` asks for); EPLB_HAVE_X tells config.h what was built.
set(EPLB_HAVE_UCX OFF)
set(EPLB_HAVE_GLOO OFF)
set(EPLB_HAVE_MPI OFF)
set(EPLB_HAVE_CUDA OFF)

# eplb_backend(NAME LIBRARY FOUND HINT): sets EPLB_HAVE_<NAME> from EPLB_WITH_<NAME> (ON, OFF,
# AUTO) and whether the dependency LIBRARY was FOUND; ON without it stops with HINT.
function(eplb_backend name library found hint)
  set(with "${EPLB_WITH_${name}}")
  string(TOUPPER "${with}" with_upper)
  if(with_upper STREQUAL "AUTO")
    if(${found})
      message(STATUS "eplb: ${library} found, its backend is built (EPLB_WITH_${name}=AUTO)")
      set(EPLB_HAVE_${name} ON PARENT_SCOPE)
    else()
      message(STATUS "eplb: ${library} not found, its backend is left out (EPLB_WITH_${name}=AUTO; "
                     "${hint})")
    endif()
  elseif(with)
    if(NOT ${found})
      message(FATAL_ERROR "EPLB_WITH_${name}=ON but ${library} was not found: ${hint}, or "
                          "configure with -DEPLB_WITH_${name}=OFF (or AUTO)")
    endif()
    set(EPLB_HAVE_${name} ON PARENT_SCOPE)
  endif()
endfunction()

if(EPLB_WITH_UCX)
  find_package(PkgConfig)
  if(PkgConfig_FOUND)
    pkg_check_modules(UCX IMPORTED_TARGET ucx)
  endif()
endif()
eplb_backend(UCX UCX UCX_FOUND "install libucx-dev (apt-get install libucx-dev)")

if(EPLB_WITH_GLOO)
  find_package(Gloo CONFIG QUIET)
  # Debian's gloo is built with GLOO_USE_REDIS: its redis_store.h includes <hiredis.h>, which
  # Debian installs as <hiredis/hiredis.h> (libhiredis-dev).
  find_path(EPLB_HIREDIS_INCLUDE_DIR hiredis/hiredis.h)
  set(eplb_gloo_found OFF)
  if(TARGET gloo AND EPLB_HIREDIS_INCLUDE_DIR)
    set(eplb_gloo_found ON)
  endif()
endif()
eplb_backend(GLOO gloo eplb_gloo_found
             "install libgloo-dev and libhiredis-dev (apt-get install libgloo-dev libhiredis-dev)")

if(EPLB_WITH_MPI)
  find_package(MPI COMPONENTS C)
endif()
eplb_backend(MPI MPI MPI_C_FOUND "install libopenmpi-dev and openmpi-bin")

if(EPLB_WITH_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "EPLB_WITH_CUDA=ON but no CUDA compiler was found: set "
                        "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc or configure with "
                        "-DEPLB_WITH_CUDA=OFF")
  endif()
  # No GPU is needed to build: compile for Hopper (H100/H200) unless told otherwise, never for
  # "native", which asks a GPU that a build machine may not have.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  # CMake before 3.26 does not know nvcc's C++20 flag (the headers need std::span).
  if(CMAKE_VERSION VERSION_LESS 3.26 AND NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  # One CUDA runtime in every program: the shared one, as CUDA::cudart links.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  set(EPLB_HAVE_CUDA ON)
endif()
