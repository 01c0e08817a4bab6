# The source gates, as build targets (run by .ci/run):
#   check-format  every tracked C++ file but the generated stages/ matches .clang-format (tools/check-format;
#                 `tools/check-format --fix` rewrites them)
#   check-tidy    clang-tidy with .clang-tidy over common/ and solutions/, on this build's compile commands; only
#                 files whose input changed since they passed (.ci/tidy-passed)
#                 (tools/check-tidy)
add_custom_target(check-format
  COMMAND ${PROJECT_SOURCE_DIR}/tools/check-format
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
  COMMENT "clang-format: every C++ file matches .clang-format"
  VERBATIM USES_TERMINAL)
add_custom_target(check-tidy
  COMMAND ${PROJECT_SOURCE_DIR}/tools/check-tidy ${CMAKE_BINARY_DIR}
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
  COMMENT "clang-tidy: common/ and solutions/ pass .clang-tidy"
  VERBATIM USES_TERMINAL)
