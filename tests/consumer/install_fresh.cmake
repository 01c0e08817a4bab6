# cmake -DBUILD=<build dir> -DPREFIX=<prefix> -P install_fresh.cmake: installs the build into an empty prefix. The
# prefix is emptied first, so a header the tree no longer has (a moved one) is not left behind for the consumer to
# include beside its new copy.
if(NOT BUILD OR NOT PREFIX OR NOT IS_ABSOLUTE "${PREFIX}")
  message(FATAL_ERROR "install_fresh: expected -DBUILD=<build dir> -DPREFIX=<absolute prefix>; got BUILD='${BUILD}' "
                      "PREFIX='${PREFIX}'")
endif()
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD}" --prefix "${PREFIX}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install_fresh: cmake --install ${BUILD} --prefix ${PREFIX} failed (${rc})")
endif()
