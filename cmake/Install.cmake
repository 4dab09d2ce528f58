# What `cmake --install build [--prefix DIR]` installs: the server (with the CUDA plugin beside it
# where built, as the server looks for it there), the CLI, and the C++ client library with its
# headers and a CMake package, so that outside this tree
#   find_package(attnserve_client 0.1 REQUIRED)
#   target_link_libraries(my_tool PRIVATE attnserve::client)
# works (docs/client.md, "Installing"). Headers go under include/attnserve/, keeping the
# in-tree spellings: #include "client/client.h", #include "attnserve/v1/attention.pb.h".
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(ATTNSERVE_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR}/attnserve)
set(ATTNSERVE_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/attnserve_client)

install(TARGETS attnserve attnserve-cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET attnserve_cuda_plugin)
  install(TARGETS attnserve_cuda_plugin LIBRARY DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

set_target_properties(attnserve_client PROPERTIES EXPORT_NAME client)
set_target_properties(attnserve_proto PROPERTIES EXPORT_NAME proto)
install(TARGETS attnserve_client attnserve_proto EXPORT attnserve_clientTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${ATTNSERVE_INSTALL_INCLUDEDIR})
install(FILES client/client.h client/npy.h DESTINATION ${ATTNSERVE_INSTALL_INCLUDEDIR}/client)
install(FILES ${PROJECT_BINARY_DIR}/proto/attnserve/v1/attention.pb.h
              ${PROJECT_BINARY_DIR}/proto/attnserve/v1/attention.grpc.pb.h
        DESTINATION ${ATTNSERVE_INSTALL_INCLUDEDIR}/attnserve/v1)
install(EXPORT attnserve_clientTargets NAMESPACE attnserve:: DESTINATION ${ATTNSERVE_INSTALL_CMAKEDIR})
configure_package_config_file(cmake/attnserve_clientConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/attnserve_clientConfig.cmake
                              INSTALL_DESTINATION ${ATTNSERVE_INSTALL_CMAKEDIR})
# 0.x: a new minor version may change the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/attnserve_clientConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/attnserve_clientConfig.cmake
              ${PROJECT_BINARY_DIR}/attnserve_clientConfigVersion.cmake
        DESTINATION ${ATTNSERVE_INSTALL_CMAKEDIR})
install(FILES LICENSE README.md CHANGELOG.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
