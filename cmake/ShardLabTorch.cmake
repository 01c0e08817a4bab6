# Finds libtorch (any line the compat layer supports: 1.13 from Debian 12, 2.x downloads), Gloo's headers (which
# c10d's ProcessGroupGloo.hpp includes), and decides whether NCCL is compiled in.
find_package(Threads REQUIRED)
find_package(Torch REQUIRED)
message(STATUS "shardlab: libtorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}")
string(APPEND CMAKE_CXX_FLAGS " ${TORCH_CXX_FLAGS}")

find_path(SHARDLAB_GLOO_INCLUDE gloo/config.h HINTS ${TORCH_INCLUDE_DIRS})
if(NOT SHARDLAB_GLOO_INCLUDE)
  message(FATAL_ERROR "Gloo headers (gloo/config.h) not found: c10d's ProcessGroupGloo.hpp needs them. "
                      "On Debian: apt-get install libgloo-dev (tools/install-deps does it).")
endif()

find_package(nlohmann_json 3.2 REQUIRED)  # Debian: nlohmann-json3-dev (tools/install-deps)
find_package(ZLIB REQUIRED)               # Debian: zlib1g-dev

# NCCL: only with a CUDA libtorch whose c10d ships ProcessGroupNCCL.
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  set(SHARDLAB_HAS_NCCL ON)
else()
  set(SHARDLAB_HAS_NCCL OFF)
endif()
message(STATUS "shardlab: NCCL backend ${SHARDLAB_HAS_NCCL}")
