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

function(shardlab_add_stage dir)
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
#  1. ${CMAKE_BINARY_DIR}/stage_headers/NN_name: a copy of each header that differs between solutions/ and
#     stages/ (one with a region: the student's private state), taken from the tree the stage is built from;
#  2. solutions/NN_name/include: every other header (identical in both trees).
# So the compile command of everything that includes a stage's headers (later stages, tests, tools) is the same in
# either build, and switching one stage to its starter (tools/check-starter) recompiles only what includes a
# header whose copy changed: configure_file rewrites a copy only when its content changes, and make compares the
# copy's time. Later stages include the region-free headers (naive_ddp/no_sync.h, naive_ddp/broadcast_state.h,
# bucketed_ddp/bucket_reducer.h), not the headers with regions, so their libraries are not recompiled; what does
# include a region header (that stage's and stage 03's tests, the tool's strategies.cpp) is. An IDE that opens a
# copy opens a generated file: edit the header under solutions/.
function(shardlab_stage_headers out)
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  string(REGEX REPLACE "^[^/]+/" "" dir "${rel}")
  set(solution ${PROJECT_SOURCE_DIR}/solutions/${dir}/include)
  set(starter ${PROJECT_SOURCE_DIR}/stages/${dir}/include)
  set(copies ${PROJECT_BINARY_DIR}/stage_headers/${dir})
  file(GLOB_RECURSE headers RELATIVE ${solution} CONFIGURE_DEPENDS ${solution}/*)
  set(differing)
  foreach(h IN LISTS headers)
    if(EXISTS ${starter}/${h})
      # An edit of either copy re-runs the comparison.
      set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${solution}/${h} ${starter}/${h})
      file(SHA256 ${solution}/${h} a)
      file(SHA256 ${starter}/${h} b)
      if(NOT a STREQUAL b)
        list(APPEND differing ${h})
        configure_file(${CMAKE_CURRENT_SOURCE_DIR}/include/${h} ${copies}/${h} COPYONLY)
      endif()
    endif()
  endforeach()
  file(MAKE_DIRECTORY ${copies})
  file(GLOB_RECURSE present RELATIVE ${copies} ${copies}/*)
  foreach(h IN LISTS present)  # a header that no longer differs is found under solutions/ again
    if(NOT h IN_LIST differing)
      file(REMOVE ${copies}/${h})
    endif()
  endforeach()
  set(${out} ${copies} ${solution} PARENT_SCOPE)
endfunction()

function(shardlab_stage_library name)
  cmake_parse_arguments(S "" "" "SOURCES;LINKS" ${ARGN})
  add_library(shardlab_${name} ${S_SOURCES})
  add_library(shardlab::${name} ALIAS shardlab_${name})
  set_target_properties(shardlab_${name} PROPERTIES EXPORT_NAME ${name})
  shardlab_stage_headers(headers)  # see Note [A starter's headers]
  list(GET headers 0 copies)
  list(GET headers 1 solution)
  target_include_directories(shardlab_${name} PUBLIC
    $<BUILD_INTERFACE:${copies}>
    $<BUILD_INTERFACE:${solution}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(shardlab_${name} PUBLIC ${S_LINKS})
  target_compile_options(shardlab_${name} PRIVATE -Wall -Wextra)
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/shardlab DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(TARGETS shardlab_${name} EXPORT ShardLabTargets)
endfunction()
