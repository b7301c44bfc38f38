# eplb_cuda_transport_measure: pull bandwidth of the cuda transport between two processes beside
# a same-process device-to-device copy, and what a migration costs a GEMM loop running beside it.
# A plain program (no Google Benchmark); its SGEMM kernel is its own (no cuBLAS).
# Included from bench/cuda/CMakeLists.txt.
add_executable(eplb_cuda_transport_measure
  ${CMAKE_CURRENT_LIST_DIR}/transport_measure.cc
  ${CMAKE_CURRENT_LIST_DIR}/transport_measure_gemm.cu)
target_link_libraries(eplb_cuda_transport_measure PRIVATE eplb_transport eplb_warnings
  CUDA::cudart nlohmann_json::nlohmann_json Threads::Threads)
