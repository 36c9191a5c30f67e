# What `cmake --install` puts in place besides the binaries and libepdclient.so: the CMake
# package (lib/cmake/epd: find_package(epd CONFIG) -> epd::client) and the pkg-config file
# (lib/pkgconfig/epd.pc). Both describe libepdclient.so, the C ABI (<epd/epd.h>) only; the
# C++ API and the static library stay in the build tree. tests/install/ builds consumers of
# the installed tree with each.
include(CMakePackageConfigHelpers)
set(EPD_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/epd)
install(EXPORT epdTargets NAMESPACE epd:: FILE epdTargets.cmake DESTINATION ${EPD_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/epdConfig.cmake.in
  ${PROJECT_BINARY_DIR}/epdConfig.cmake INSTALL_DESTINATION ${EPD_CMAKE_DIR})
# The same major version is compatible, as libepdclient's SONAME (SOVERSION = major).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/epdConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/epdConfig.cmake ${PROJECT_BINARY_DIR}/epdConfigVersion.cmake
        DESTINATION ${EPD_CMAKE_DIR})

# epd.pc finds its prefix from its own place (${pcfiledir}), so the installed tree can move.
foreach(kind LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${kind}}")
    set(EPD_PC_${kind} "${CMAKE_INSTALL_${kind}}")
  else()
    set(EPD_PC_${kind} "\${prefix}/${CMAKE_INSTALL_${kind}}")
  endif()
endforeach()
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(EPD_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH EPD_PC_UP "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
  string(REGEX REPLACE "/$" "" EPD_PC_UP "${EPD_PC_UP}")
  set(EPD_PC_PREFIX "\${pcfiledir}/${EPD_PC_UP}")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/epd.pc.in ${PROJECT_BINARY_DIR}/epd.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/epd.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
