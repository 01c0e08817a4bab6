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
  add_subdirectory(${root} ${CMAKE_BINARY_DIR}/stage_${dir})
  set(SHARDLAB_STAGES ${SHARDLAB_STAGES} ${dir} CACHE INTERNAL "stages added so far")
endfunction()

# shardlab_stage_library(<name> SOURCES <files...> LINKS <targets...>): the library of one stage, called from the
# stage's CMakeLists.txt: target shardlab_<name> (alias shardlab::<name>, exported as <name>) built from SOURCES,
# with the stage's include/ directory, linked PUBLIC to LINKS (the stages it builds on), installed and exported.
function(shardlab_stage_library name)
  cmake_parse_arguments(S "" "" "SOURCES;LINKS" ${ARGN})
  add_library(shardlab_${name} ${S_SOURCES})
  add_library(shardlab::${name} ALIAS shardlab_${name})
  set_target_properties(shardlab_${name} PROPERTIES EXPORT_NAME ${name})
  target_include_directories(shardlab_${name} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(shardlab_${name} PUBLIC ${S_LINKS})
  target_compile_options(shardlab_${name} PRIVATE -Wall -Wextra)
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/shardlab DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(TARGETS shardlab_${name} EXPORT ShardLabTargets)
endfunction()
