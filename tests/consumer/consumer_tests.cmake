# Package test: install this build into a scratch prefix, then configure, build and run tests/consumer — a
# separate project that only does find_package(ShardLab) — as 4 processes under the installed shardlab-run.
set(_prefix ${CMAKE_BINARY_DIR}/consumer-install)
set(_build ${CMAKE_BINARY_DIR}/consumer-build)
add_test(NAME package_install
  COMMAND ${CMAKE_COMMAND} -DBUILD=${CMAKE_BINARY_DIR} -DPREFIX=${_prefix}
          -P ${CMAKE_CURRENT_SOURCE_DIR}/consumer/install_fresh.cmake)
add_test(NAME package_consumer_build
  COMMAND ${CMAKE_COMMAND} -E env --unset=CMAKE_PREFIX_PATH
          ${CMAKE_CTEST_COMMAND} --build-and-test ${CMAKE_CURRENT_SOURCE_DIR}/consumer ${_build}
          --build-generator ${CMAKE_GENERATOR}
          --build-options -DCMAKE_PREFIX_PATH=${_prefix} -DTorch_DIR=${Torch_DIR} -DCMAKE_BUILD_TYPE=Release
                          # this build's flags: a sanitized shardlab (the asan preset) needs a sanitized consumer
                          "-DCMAKE_CXX_FLAGS=${CMAKE_CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${CMAKE_EXE_LINKER_FLAGS}"
          --test-command ${_prefix}/bin/shardlab-run -n 4 --timeout 240 -- ${_build}/shardlab_consumer)
set_tests_properties(package_install PROPERTIES LABELS package TIMEOUT 120 FIXTURES_SETUP shardlab_installed
                                                COST 30)  # first: the consumer's build (27 s) waits for it
set_tests_properties(package_consumer_build PROPERTIES LABELS package TIMEOUT 300
  FIXTURES_REQUIRED shardlab_installed PASS_REGULAR_EXPRESSION "consumer: ok" COST 27)
