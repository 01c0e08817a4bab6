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
# Note [A starter's headers]: a stage built from its starter keeps its headers' include path under solutions/
# when every header there is identical to the starter's (no region in a header). Everything that includes them
# (later stages, tests, tools) then sees the same compile command in either build and is not recompiled when
# tools/check-starter switches one stage to its starter; only the stage's own sources are. A stage whose
# headers differ (a region in a header) uses its starter's headers, and what includes them is rebuilt.
function(shardlab_stage_headers out)
  set(inc ${CMAKE_CURRENT_SOURCE_DIR}/include)
  file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  if(rel MATCHES "^stages/(.*)$")
    set(reference ${PROJECT_SOURCE_DIR}/solutions/${CMAKE_MATCH_1}/include)
    file(GLOB_RECURSE mine RELATIVE ${inc} CONFIGURE_DEPENDS ${inc}/*)
    file(GLOB_RECURSE theirs RELATIVE ${reference} CONFIGURE_DEPENDS ${reference}/*)
    list(SORT mine)
    list(SORT theirs)
    set(same OFF)
    if(mine STREQUAL theirs)
      set(same ON)
      foreach(h IN LISTS mine)
        # An edit of either copy re-runs the comparison.
        set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${inc}/${h} ${reference}/${h})
        file(SHA256 ${inc}/${h} a)
        file(SHA256 ${reference}/${h} b)
        if(NOT a STREQUAL b)
          set(same OFF)
          break()
        endif()
      endforeach()
    endif()
    if(same)
      set(inc ${reference})
    endif()
  endif()
  set(${out} ${inc} PARENT_SCOPE)
endfunction()

function(shardlab_stage_library name)
  cmake_parse_arguments(S "" "" "SOURCES;LINKS" ${ARGN})
  add_library(shardlab_${name} ${S_SOURCES})
  add_library(shardlab::${name} ALIAS shardlab_${name})
  set_target_properties(shardlab_${name} PROPERTIES EXPORT_NAME ${name})
  shardlab_stage_headers(headers)  # see Note [A starter's headers]
  target_include_directories(shardlab_${name} PUBLIC
    $<BUILD_INTERFACE:${headers}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(shardlab_${name} PUBLIC ${S_LINKS})
  target_compile_options(shardlab_${name} PRIVATE -Wall -Wextra)
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/shardlab DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(TARGETS shardlab_${name} EXPORT ShardLabTargets)
endfunction()
