# One precompiled header of libtorch's headers, shared by every shardlab target (see Note [One precompiled header]).
#
#   shardlab_use_pch(<target> [TEST])   the target reuses it (a no-op when SHARDLAB_PCH is OFF, unless TEST names a
#                                       test program and SHARDLAB_TEST_PCH is ON)
#
# Note [One precompiled header]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A shardlab translation unit spends about half its compile time parsing libtorch's headers (ATen alone is 250k
# lines after preprocessing): 12 s for an FSDP source here, 6 s with the headers precompiled. Each target making its
# own PCH would cost 20 s per target, so two holder targets make it once and every other target reuses theirs
# (REUSE_FROM): one for libraries (-fPIC) and one for executables (-fPIE), because GCC refuses a PCH made with the
# other (and says so under -Winvalid-pch, which CMake adds).
#
# What it costs: a forced include hides a missing #include. The sanitizer preset (asan) builds the libraries and
# tools without it, and tools/check-tidy strips it from the compile commands, so both still compile every file a
# user's build compiles on its own includes. A library user's build never sees it: it is PRIVATE to shardlab's own
# targets and not exported.
#
# The asan preset's test programs do use it (SHARDLAB_TEST_PCH): their 51 files are a third of that build, 15 s each
# without it under ASan (half that with it), and no user compiles them. Only the executables' holder is made then.
# What that costs: a test file that misses an include still compiles there; tools/check-tidy, which compiles every
# file of common/ and solutions/ on its own includes, does not reach tests/ either.
option(SHARDLAB_PCH "Precompile libtorch's headers once for every shardlab target (Note [One precompiled header])"
       ${SHARDLAB_MAIN_PROJECT})
option(SHARDLAB_TEST_PCH "Precompile libtorch's headers for the test programs even where SHARDLAB_PCH is OFF" OFF)

if(SHARDLAB_PCH OR (SHARDLAB_TEST_PCH AND SHARDLAB_BUILD_TESTS))
  set(_pch_source ${CMAKE_BINARY_DIR}/shardlab_pch.cpp)
  file(CONFIGURE OUTPUT ${_pch_source} CONTENT "// The holder of shardlab's precompiled header (cmake/ShardLabPch.cmake).\n")
  set(_kinds pie)
  if(SHARDLAB_PCH)
    list(PREPEND _kinds pic)
  endif()
  foreach(_kind ${_kinds})
    add_library(shardlab_pch_${_kind} OBJECT ${_pch_source})
    # What shardlab's own targets compile with: libtorch's usage requirements (defines, include directories) and
    # the NCCL switch, the only define of shardlab_core that reaches its users.
    target_link_libraries(shardlab_pch_${_kind} PRIVATE ${TORCH_LIBRARIES})
    target_include_directories(shardlab_pch_${_kind} SYSTEM PRIVATE ${TORCH_INCLUDE_DIRS})
    if(SHARDLAB_HAS_NCCL)
      target_compile_definitions(shardlab_pch_${_kind} PRIVATE SHARDLAB_HAS_NCCL)
    endif()
    target_precompile_headers(shardlab_pch_${_kind} PRIVATE
      <ATen/ATen.h>
      <torch/nn/module.h>
      <torch/optim/optimizer.h>
      <torch/csrc/distributed/c10d/ProcessGroup.hpp>)
  endforeach()
  # Executables compile with -fPIE (CMAKE_POSITION_INDEPENDENT_CODE): an object library cannot ask for it, so the
  # flag is given by hand.
  set_target_properties(shardlab_pch_pie PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(shardlab_pch_pie PRIVATE -fPIE)
endif()

function(shardlab_use_pch target)
  cmake_parse_arguments(P "TEST" "" "" ${ARGN})
  if(NOT SHARDLAB_PCH AND NOT (P_TEST AND SHARDLAB_TEST_PCH))
    return()
  endif()
  get_target_property(type ${target} TYPE)
  if(P_TEST AND NOT type STREQUAL "EXECUTABLE")
    message(FATAL_ERROR "shardlab_use_pch(${target} TEST): expected a test program (an executable); got a ${type}")
  endif()
  if(type STREQUAL "EXECUTABLE")
    target_precompile_headers(${target} REUSE_FROM shardlab_pch_pie)
  else()
    target_precompile_headers(${target} REUSE_FROM shardlab_pch_pic)
  endif()
endfunction()
