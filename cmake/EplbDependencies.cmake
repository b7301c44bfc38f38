# Optional backends. Each EPLB_WITH_X that is ON must find its dependency or stop here with a
# message naming the Debian package; EPLB_HAVE_X tells config.h what was built.
set(EPLB_HAVE_UCX OFF)
set(EPLB_HAVE_GLOO OFF)
set(EPLB_HAVE_MPI OFF)
set(EPLB_HAVE_CUDA OFF)

if(EPLB_WITH_UCX)
  find_package(PkgConfig)
  if(PkgConfig_FOUND)
    pkg_check_modules(UCX IMPORTED_TARGET ucx)
  endif()
  if(NOT UCX_FOUND)
    message(FATAL_ERROR "EPLB_WITH_UCX=ON but UCX was not found: install libucx-dev "
                        "(apt-get install libucx-dev) or configure with -DEPLB_WITH_UCX=OFF")
  endif()
  set(EPLB_HAVE_UCX ON)
endif()

if(EPLB_WITH_GLOO)
  find_package(Gloo CONFIG QUIET)
  if(NOT TARGET gloo)
    message(FATAL_ERROR "EPLB_WITH_GLOO=ON but gloo was not found: install libgloo-dev "
                        "(apt-get install libgloo-dev) or configure with -DEPLB_WITH_GLOO=OFF")
  endif()
  set(EPLB_HAVE_GLOO ON)
endif()

if(EPLB_WITH_MPI)
  find_package(MPI COMPONENTS C)
  if(NOT MPI_C_FOUND)
    message(FATAL_ERROR "EPLB_WITH_MPI=ON but MPI was not found: install libopenmpi-dev and "
                        "openmpi-bin, or configure with -DEPLB_WITH_MPI=OFF")
  endif()
  set(EPLB_HAVE_MPI ON)
endif()

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
