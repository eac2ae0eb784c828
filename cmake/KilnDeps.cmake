# Third-party libraries, as imported targets Kiln::inih, Kiln::cmocka and Kiln::openblas.
# pkg-config is the normal way (Debian's -dev packages ship .pc files); where pkg-config is
# absent (e.g. a GPU image with the libraries unpacked under CMAKE_PREFIX_PATH) the headers and
# libraries are searched for directly.
find_package(PkgConfig QUIET)

# kiln_find_dep(TARGET PCNAME HEADER LIBNAMES... [PATH_SUFFIXES ...] [OPTIONAL])
function(kiln_find_dep target pcname header)
  cmake_parse_arguments(D "OPTIONAL" "" "NAMES;PATH_SUFFIXES" ${ARGN})
  if(TARGET ${target})
    return()
  endif()
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(_kd_${pcname} QUIET IMPORTED_TARGET GLOBAL ${pcname})
    if(_kd_${pcname}_FOUND)
      add_library(${target} ALIAS PkgConfig::_kd_${pcname})
      message(STATUS "${target}: pkg-config ${pcname} ${_kd_${pcname}_VERSION}")
      return()
    endif()
  endif()
  find_path(_kd_${pcname}_INC ${header} PATH_SUFFIXES ${D_PATH_SUFFIXES})
  find_library(_kd_${pcname}_LIB NAMES ${D_NAMES} PATH_SUFFIXES ${D_PATH_SUFFIXES})
  if(_kd_${pcname}_INC AND _kd_${pcname}_LIB)
    add_library(${target} UNKNOWN IMPORTED GLOBAL)
    set_target_properties(${target} PROPERTIES IMPORTED_LOCATION ${_kd_${pcname}_LIB}
      INTERFACE_INCLUDE_DIRECTORIES ${_kd_${pcname}_INC})
    message(STATUS "${target}: ${_kd_${pcname}_LIB}")
  elseif(NOT D_OPTIONAL)
    message(FATAL_ERROR "${target}: ${pcname} not found. On Debian: apt-get install "
      "libinih-dev libcmocka-dev libopenblas-dev libpcre2-dev libutf8proc-dev libxxhash-dev "
      "libcurl4-openssl-dev libmicrohttpd-dev libpng-dev libjpeg62-turbo-dev libwebp-dev "
      "pkg-config "
      "(or run `make deps`).")
  endif()
endfunction()

kiln_find_dep(Kiln::inih inih ini.h NAMES inih)
kiln_find_dep(Kiln::pcre2 libpcre2-8 pcre2.h NAMES pcre2-8)
kiln_find_dep(Kiln::utf8proc libutf8proc utf8proc.h NAMES utf8proc)
kiln_find_dep(Kiln::xxhash libxxhash xxhash.h NAMES xxhash)
# Image input (models/vision): libpng, libjpeg-turbo (its libjpeg API), libwebp.
kiln_find_dep(Kiln::png libpng png.h NAMES png16 png)
kiln_find_dep(Kiln::jpeg libjpeg jpeglib.h NAMES jpeg)
kiln_find_dep(Kiln::webp libwebp webp/decode.h NAMES webp)
kiln_find_dep(Kiln::openblas openblas cblas.h NAMES openblas
  PATH_SUFFIXES openblas-pthread openblas-openmp openblas-serial)
if(KILN_BUILD_TESTS)
  kiln_find_dep(Kiln::cmocka cmocka cmocka.h NAMES cmocka)
endif()

# libFuzzer's runtime (KILN_FUZZ) is compiler-rt's, a package of its own on Debian
# (libclang-rt-14-dev for clang 14) that clang only recommends: say so rather than fail at link.
if(KILN_FUZZ)
  include(CheckCSourceCompiles)
  set(CMAKE_REQUIRED_FLAGS "-fsanitize=fuzzer,address,undefined")
  check_c_source_compiles("#include <stddef.h>
    #include <stdint.h>
    int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);
    int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return d && n > 1 ? 0 : 0; }"
    KILN_HAVE_LIBFUZZER)
  unset(CMAKE_REQUIRED_FLAGS)
  if(NOT KILN_HAVE_LIBFUZZER)
    message(FATAL_ERROR "KILN_FUZZ: ${CMAKE_C_COMPILER} cannot link -fsanitize=fuzzer,address,undefined: "
      "libFuzzer's runtime is missing. On Debian 12: apt-get install libclang-rt-14-dev "
      "(or run `make deps`).")
  endif()
endif()
