# Exported CMake package: find_package(ShardLab) gives shardlab::core and the stages' shardlab::naive_ddp ...
# shardlab::hsdp (the library), and shardlab::course (the course's parts; shardlab::common, its 0.1 name, for one
# release).
include(CMakePackageConfigHelpers)
set(SHARDLAB_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ShardLab)
install(EXPORT ShardLabTargets NAMESPACE shardlab:: DESTINATION ${SHARDLAB_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ShardLabConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/ShardLabConfig.cmake INSTALL_DESTINATION ${SHARDLAB_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/ShardLabConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ShardLabConfig.cmake ${CMAKE_CURRENT_BINARY_DIR}/ShardLabConfigVersion.cmake
  DESTINATION ${SHARDLAB_CMAKE_DIR})
