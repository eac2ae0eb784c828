# Install rules: the SDK a third party needs to build a backend plugin (headers, kiln.pc,
# KilnConfig.cmake with the Kiln::hal interface target and kiln_add_plugin()), libkiln, the
# kiln command, plugins and the default config.
include(CMakePackageConfigHelpers)

install(FILES hal/include/kiln/hal.h hal/include/kiln/hal_util.h hal/include/kiln/hal_check.h
        hal/include/kiln/hal_rank.h
        include/kiln/kiln.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kiln)
install(FILES hal/plugin.map DESTINATION ${CMAKE_INSTALL_DATADIR}/kiln)
install(TARGETS kiln LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
# The installed kiln.ini names the installed default model by its absolute path.
file(READ ${PROJECT_SOURCE_DIR}/etc/kiln.ini _kiln_ini)
string(REPLACE "path = ../share/models/kiln-tiny"
  "path = ${CMAKE_INSTALL_FULL_DATADIR}/kiln/models/kiln-tiny" _kiln_ini "${_kiln_ini}")
file(WRITE ${PROJECT_BINARY_DIR}/kiln.ini "${_kiln_ini}")
install(FILES ${PROJECT_BINARY_DIR}/kiln.ini DESTINATION ${CMAKE_INSTALL_SYSCONFDIR}/kiln)
if(EXISTS ${PROJECT_SOURCE_DIR}/share/models/kiln-tiny/config.json)
  install(DIRECTORY share/models/kiln-tiny DESTINATION ${CMAKE_INSTALL_DATADIR}/kiln/models
    PATTERN "*.py" EXCLUDE)
endif()

set(KILN_PC_PLUGINDIR "\${libdir}/kiln")
# Relocatable: the prefix is found from the .pc file's own place (pkg-config's ${pcfiledir}).
file(RELATIVE_PATH KILN_PC_TO_PREFIX "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
configure_file(cmake/kiln.pc.in ${PROJECT_BINARY_DIR}/kiln.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/kiln.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(TARGETS kiln_hal_headers EXPORT KilnTargets)
install(EXPORT KilnTargets NAMESPACE Kiln:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Kiln)
configure_package_config_file(cmake/KilnConfig.cmake.in
  ${PROJECT_BINARY_DIR}/KilnConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Kiln
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR CMAKE_INSTALL_DATADIR KILN_INSTALL_PLUGINDIR)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/KilnConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/KilnConfig.cmake ${PROJECT_BINARY_DIR}/KilnConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Kiln)
