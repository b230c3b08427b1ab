# Finds the C++ Actor Framework 0.17 as Debian ships it (headers and libraries, no CMake config):
# defines CAF_FOUND, CAF_VERSION and the imported targets CAF::core, CAF::io and CAF::openssl.
find_path(CAF_INCLUDE_DIR caf/all.hpp)
find_library(CAF_CORE_LIBRARY caf_core)
find_library(CAF_IO_LIBRARY caf_io)
find_library(CAF_OPENSSL_LIBRARY caf_openssl)
if(CAF_INCLUDE_DIR AND EXISTS ${CAF_INCLUDE_DIR}/caf/config.hpp)
  file(STRINGS ${CAF_INCLUDE_DIR}/caf/config.hpp _caf_ver REGEX "#define CAF_VERSION [0-9]+")
  string(REGEX MATCH "[0-9]+" _caf_num "${_caf_ver}")
  if(_caf_num)
    math(EXPR _major "${_caf_num} / 10000")
    math(EXPR _minor "(${_caf_num} / 100) % 100")
    math(EXPR _patch "${_caf_num} % 100")
    set(CAF_VERSION "${_major}.${_minor}.${_patch}")
  endif()
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CAF REQUIRED_VARS CAF_INCLUDE_DIR CAF_CORE_LIBRARY CAF_IO_LIBRARY CAF_OPENSSL_LIBRARY VERSION_VAR CAF_VERSION)
find_package(OpenSSL REQUIRED)  # CAF's OpenSSL module (TLS between replicas) and our certificate checks
if(CAF_FOUND AND NOT TARGET CAF::core)
  add_library(CAF::core UNKNOWN IMPORTED)
  set_target_properties(CAF::core PROPERTIES IMPORTED_LOCATION ${CAF_CORE_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${CAF_INCLUDE_DIR}
                        INTERFACE_LINK_LIBRARIES Threads::Threads)
  add_library(CAF::io UNKNOWN IMPORTED)
  set_target_properties(CAF::io PROPERTIES IMPORTED_LOCATION ${CAF_IO_LIBRARY}
                        INTERFACE_LINK_LIBRARIES CAF::core)
  add_library(CAF::openssl UNKNOWN IMPORTED)
  set_target_properties(CAF::openssl PROPERTIES IMPORTED_LOCATION ${CAF_OPENSSL_LIBRARY}
                        INTERFACE_LINK_LIBRARIES "CAF::io;OpenSSL::SSL")
endif()
