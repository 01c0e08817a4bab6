# Course machinery: each stage is built either from its reference solution (solutions/NN_name, the source of truth)
# or from the generated student starter (stages/NN_name), chosen per stage with SHARDLAB_STARTER_STAGES.
set(SHARDLAB_STAGES "" CACHE INTERNAL "stages added so far")

function(shardlab_stage_uses_starter dir out)
  string(SUBSTRING "${dir}" 0 2 num)
  if("all" IN_LIST SHARDLAB_STARTER_STAGES OR num IN_LIST SHARDLAB_STARTER_STAGES)
    set(${out} ON PARENT_SCOPE)
  else()
    set(${out} OFF PARENT_SCOPE)
  endif()
endfunction()

# Note [The open track's build]
# SHARDLAB_OPEN_STAGE=NN builds stage NN from its open-track starter, stages/NN_name/open (tools/gen_open.py): the
# stage's public headers without the solution's private state, and the student's own sources. Later stages and
# the tools are left out: they use the solution's internal headers and extension points, which the open starter
# does not have (the student's design need not offer them). So are every other stage's tests, and the tests that
# reach into an internal seam of this one (label `guided`: shardlab_add_test_suite in tests/CMakeLists.txt). The
# stage's headers come from the open tree alone, never from solutions/, so a student's file that includes an
# internal header of the solution fails to compile instead of linking against nothing.
function(shardlab_check_open_stage)  # SHARDLAB_OPEN_STAGE: a stage with an open track, by its two digits
  if(NOT SHARDLAB_OPEN_STAGE)
    return()
  endif()
  file(GLOB open_tracks RELATIVE ${PROJECT_SOURCE_DIR}/stages ${PROJECT_SOURCE_DIR}/stages/*/open/CMakeLists.txt)
  set(open_numbers)
  foreach(track IN LISTS open_tracks)
    string(SUBSTRING "${track}" 0 2 num)
    list(APPEND open_numbers ${num})
  endforeach()
  if(NOT SHARDLAB_OPEN_STAGE IN_LIST open_numbers)
    string(REPLACE ";" ", " open_numbers "${open_numbers}")
    message(FATAL_ERROR "shardlab: SHARDLAB_OPEN_STAGE: expected the two digits of a stage with an open track "
                        "(stages/NN_name/open: ${open_numbers}); got '${SHARDLAB_OPEN_STAGE}'")
  endif()
endfunction()
shardlab_check_open_stage()

function(shardlab_add_stage dir)
  string(SUBSTRING "${dir}" 0 2 num)
  if(SHARDLAB_OPEN_STAGE)
    if(num STREQUAL SHARDLAB_OPEN_STAGE)
      if(num IN_LIST SHARDLAB_STARTER_STAGES OR "all" IN_LIST SHARDLAB_STARTER_STAGES)
        message(FATAL_ERROR "shardlab: stage ${dir} is asked for from both tracks: SHARDLAB_OPEN_STAGE=${num} and "
                            "SHARDLAB_STARTER_STAGES=${SHARDLAB_STARTER_STAGES}; expected one")
      endif()
      message(STATUS "shardlab: stage ${dir} from the OPEN TRACK (stages/${dir}/open)")
      add_subdirectory(${PROJECT_SOURCE_DIR}/stages/${dir}/open ${CMAKE_BINARY_DIR}/stage_${dir}_open)
      set(SHARDLAB_STAGES ${SHARDLAB_STAGES} ${dir} CACHE INTERNAL "stages added so far")
      return()
    elseif(num GREATER SHARDLAB_OPEN_STAGE)
      return()
    endif()
  endif()
  shardlab_stage_uses_starter(${dir} starter)
  if(starter)
    set(root ${PROJECT_SOURCE_DIR}/stages/${dir})
    message(STATUS "shardlab: stage ${dir} from the STARTER (stages/${dir})")
  else()
    set(root ${PROJECT_SOURCE_DIR}/solutions/${dir})
  endif()
  if(NOT EXISTS ${root}/CMakeLists.txt)
    message(FATAL_ERROR "shardlab: ${root} is missing; regenerate stages with tools/gen_stages.py")
  endif()
  # Each source tree builds in its own directory: the same object path for both would keep a stale object when
  # a switch brings a source file older than it (make compares times, and the compile command is the same).
  if(starter)
    add_subdirectory(${root} ${CMAKE_BINARY_DIR}/stage_${dir}_starter)
  else()
    add_subdirectory(${root} ${CMAKE_BINARY_DIR}/stage_${dir})
  endif()
  set(SHARDLAB_STAGES ${SHARDLAB_STAGES} ${dir} CACHE INTERNAL "stages added so far")
endfunction()

# shardlab_stage_library(<name> SOURCES <files...> LINKS <targets...>): the library of one stage, called from the
# stage's CMakeLists.txt: target shardlab_<name> (alias shardlab::<name>, exported as <name>) built from SOURCES,
# with the stage's include/ directory, linked PUBLIC to LINKS (the stages it builds on), installed and exported.
#
# Note [A starter's headers]
# A stage's headers are found in two directories, in this order, whichever tree the stage is built from:
#  1. ${CMAKE_BINARY_DIR}/stage_headers/NN_name: for each header that differs between solutions/ and stages/ (one
#     with a region: the student's private state), a two-line forwarding header that #includes the real header of
#     the tree the stage is built from, by its absolute path;
#  2. solutions/NN_name/include: every other header (identical in both trees).
# So the compile command of everything that includes a stage's headers (later stages, tests, tools) is the same in
# either build, and switching one stage to its starter (tools/check-starter) recompiles only what includes a
# header whose forwarder changed: a forwarder is rewritten only when the tree it points to changes, and make
# compares its time. Later stages include the region-free headers (naive_ddp/broadcast_state.h,
# bucketed_ddp/bucket_reducer.h), not the headers with regions, so their libraries
# are not recompiled; what does include a region header (that stage's and stage 03's tests, the tool's
# strategies.cpp and runners.cpp) is.
# Why a forwarder and not a copy: a copy is taken when CMake configures, so a header a student edits while a build
# runs was compiled from the stale copy, and the compiler's errors named the copy under build/, a file the student
# never wrote. Through the forwarder the compiler reads the student's file itself, names it in every diagnostic,
# and the dependency scanner records it, so an edit recompiles what includes it without a new configure.
function(shardlab_stage_headers out)
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  string(REGEX REPLACE "^[^/]+/" "" dir "${rel}")
  set(solution ${PROJECT_SOURCE_DIR}/solutions/${dir}/include)
  set(starter ${PROJECT_SOURCE_DIR}/stages/${dir}/include)
  set(forwarders ${PROJECT_BINARY_DIR}/stage_headers/${dir})
  file(GLOB_RECURSE headers RELATIVE ${solution} CONFIGURE_DEPENDS ${solution}/*)
  set(differing)
  foreach(h IN LISTS headers)
    if(EXISTS ${starter}/${h})
      # An edit of either tree's header re-runs the comparison.
      set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${solution}/${h} ${starter}/${h})
      file(SHA256 ${solution}/${h} a)
      file(SHA256 ${starter}/${h} b)
      if(NOT a STREQUAL b)
        list(APPEND differing ${h})
        set(forward "// Generated by cmake/ShardLabStage.cmake: see Note [A starter's headers]. Edit the header below.\n")
        string(APPEND forward "#pragma once\n#include \"${CMAKE_CURRENT_SOURCE_DIR}/include/${h}\"\n")
        set(old "")
        if(EXISTS ${forwarders}/${h})
          file(READ ${forwarders}/${h} old)
        endif()
        if(NOT old STREQUAL forward)  # rewritten only when it changes: make compares its time
          file(WRITE ${forwarders}/${h} "${forward}")
        endif()
      endif()
    endif()
  endforeach()
  file(MAKE_DIRECTORY ${forwarders})
  file(GLOB_RECURSE present RELATIVE ${forwarders} ${forwarders}/*)
  foreach(h IN LISTS present)  # a header that no longer differs is found under solutions/ again
    if(NOT h IN_LIST differing)
      file(REMOVE ${forwarders}/${h})
    endif()
  endforeach()
  set(${out} ${forwarders} ${solution} PARENT_SCOPE)
endfunction()

function(shardlab_stage_library name)
  cmake_parse_arguments(S "" "" "SOURCES;LINKS" ${ARGN})
  add_library(shardlab_${name} ${S_SOURCES})
  add_library(shardlab::${name} ALIAS shardlab_${name})
  set_target_properties(shardlab_${name} PROPERTIES EXPORT_NAME ${name})
  if(CMAKE_CURRENT_SOURCE_DIR MATCHES "/stages/[0-9][0-9]_[^/]+/open$")  # Note [The open track's build]
    set(forwarders ${CMAKE_CURRENT_SOURCE_DIR}/include)
    set(solution ${CMAKE_CURRENT_SOURCE_DIR}/include)
  else()
    shardlab_stage_headers(headers)  # see Note [A starter's headers]
    list(GET headers 0 forwarders)
    list(GET headers 1 solution)
  endif()
  target_include_directories(shardlab_${name} PUBLIC
    $<BUILD_INTERFACE:${forwarders}>
    $<BUILD_INTERFACE:${solution}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(shardlab_${name} PUBLIC ${S_LINKS})
  target_compile_options(shardlab_${name} PRIVATE -Wall -Wextra)
  shardlab_use_pch(shardlab_${name})
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/shardlab DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(TARGETS shardlab_${name} EXPORT ShardLabTargets)
endfunction()
