# The CUDA backend's host sources (C++ over the CUDA runtime and cuBLAS), one list for the two
# builds of them: over the real toolkit (CMakeLists.txt here) and over the host emulation
# (tests/cuda_emulation). kernels.cu and the fused attention .cu files are compiled by each build its own way.
set(ATTNSERVE_CUDA_BACKEND_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/errors.cc
  ${CMAKE_CURRENT_LIST_DIR}/device_memory.cc
  ${CMAKE_CURRENT_LIST_DIR}/staging.cc
  ${CMAKE_CURRENT_LIST_DIR}/cublas_ops.cc
  ${CMAKE_CURRENT_LIST_DIR}/graph_cache.cc
  ${CMAKE_CURRENT_LIST_DIR}/lane.cc
  ${CMAKE_CURRENT_LIST_DIR}/lane_attention.cc
  ${CMAKE_CURRENT_LIST_DIR}/lane_graphs.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cc)
