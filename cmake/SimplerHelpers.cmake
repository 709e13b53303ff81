# One small helper per kind of target.

set(SIMPLER_WARNINGS -Wall -Wextra -Wno-unused-parameter)
if(SIMPLER_ENABLE_WERROR)
  list(APPEND SIMPLER_WARNINGS -Werror)
endif()
# In a unity batch g++ takes each source for a header and warns when one of its classes has a
# member of a type from the file's anonymous namespace (-Wsubobject-linkage). The warning is
# meant for headers shared by several files; a batch's sources are not, so it is off there.
if(SIMPLER_UNITY_BUILD AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  list(APPEND SIMPLER_WARNINGS -Wno-subobject-linkage)
endif()
# Clang checks the GUARDED_BY / REQUIRES annotations (g++ ignores them): every clang build
# (the sanitizer flavours) fails on a thread-safety diagnostic.
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  list(APPEND SIMPLER_WARNINGS -Wthread-safety -Werror=thread-safety)
endif()

if(SIMPLER_ENABLE_ASAN)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
endif()
if(SIMPLER_ENABLE_FUZZING)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "SIMPLER_ENABLE_FUZZING needs clang (libFuzzer); configure with "
                        "CC=clang CXX=clang++ (scripts/build.sh asan does)")
  endif()
  if(SIMPLER_ENABLE_TSAN)
    message(FATAL_ERROR "SIMPLER_ENABLE_FUZZING runs under ASan + UBSan; turn TSAN off")
  endif()
  # Every library is instrumented for coverage; only the fuzz targets link libFuzzer's main.
  # With ASAN on too (the asan flavour), the unit tests and the fuzz targets share one build.
  add_compile_options(-fsanitize=fuzzer-no-link)
  if(NOT SIMPLER_ENABLE_ASAN)
    add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer
                        -fno-sanitize-recover=undefined)
    add_link_options(-fsanitize=address,undefined)
  endif()
  # libFuzzer is in libclang-rt-<version>-dev, which Debian's clang only recommends.
  include(CheckCXXSourceCompiles)
  set(CMAKE_REQUIRED_FLAGS "-fsanitize=fuzzer")
  check_cxx_source_compiles([[
    #include <cstddef>
    #include <cstdint>
    extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }
  ]] SIMPLER_HAVE_LIBFUZZER)
  unset(CMAKE_REQUIRED_FLAGS)
  if(NOT SIMPLER_HAVE_LIBFUZZER)
    string(REGEX MATCH "^[0-9]+" clang_major "${CMAKE_CXX_COMPILER_VERSION}")
    message(FATAL_ERROR "clang cannot link -fsanitize=fuzzer: install libclang-rt-${clang_major}-dev "
                        "(scripts/install_deps.sh does)")
  endif()
endif()
if(SIMPLER_ENABLE_TSAN)
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
endif()

# simpler_library(NAME SRCS ... DEPS ...)
function(simpler_library name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SRCS})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR}/include PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(${name} PRIVATE ${SIMPLER_WARNINGS})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
endfunction()

# A test's own sources are mostly the glue around the libraries it tests (GoogleTest's macros and
# matchers, fixtures): their code generation is most of a build's time and little of a test's.
# They compile at -O0 in the sanitizer flavours (clang's -O1 with ASan took 3.4x the time of -O0
# on worker_test, whose run time did not change) and at -O1 in release (-O2 took 1.45x); the
# libraries keep their flavour's level. The last -O on the line wins. Heavy work in a test's own
# code is slow at -O0 under ASan: a byte loop over a 1 MiB arena per task took the Qwen3 program
# test from 5 s to 120 s (it now compares whole ranges with memcmp).
if(SIMPLER_ENABLE_ASAN OR SIMPLER_ENABLE_TSAN OR SIMPLER_ENABLE_FUZZING)
  set(SIMPLER_TEST_OPT -O0)
else()
  set(SIMPLER_TEST_OPT -O1)
endif()

# simpler_test(NAME SRCS ... DEPS ... LABELS ... [TIMEOUT seconds] [RELEASE_LEG])
# Every test has a time limit so a hang fails fast.
# Each flavour runs the tests that only it can check. The sanitizer flavours (SIMPLER_TESTS_ONLY)
# build and register every test: ASan + UBSan runs the "unit" label, TSan the "concurrency" one.
# A full (release) build registers only the RELEASE_LEG tests, those whose answer depends on the
# optimised code or that a sanitizer makes skip or shrink (the kernels and numerics against their
# references, the fork paths of the hierarchy, the tokenizer's 1 MiB runs), beside the e2e tests
# of the CLI. Its other tests are targets outside `all` (`ninja -C build/release worker_test`
# builds one), and -DSIMPLER_ALL_TESTS=ON builds and registers them all.
function(simpler_test name)
  cmake_parse_arguments(ARG "RELEASE_LEG" "TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  simpler_executable(${name} SRCS ${ARG_SRCS}
    DEPS ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_options(${name} PRIVATE ${SIMPLER_TEST_OPT})
  if(NOT SIMPLER_TESTS_ONLY AND NOT SIMPLER_ALL_TESTS AND NOT ARG_RELEASE_LEG)
    set_target_properties(${name} PROPERTIES EXCLUDE_FROM_ALL TRUE)
    return()
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${ARG_LABELS}")
  # `concurrency_tests` builds just what the ThreadSanitizer leg runs.
  if("concurrency" IN_LIST ARG_LABELS)
    if(NOT TARGET concurrency_tests)
      add_custom_target(concurrency_tests)
    endif()
    add_dependencies(concurrency_tests ${name})
  endif()
endfunction()

# simpler_qwen3_ref_test(NAME SRCS ... DEPS ... [TIMEOUT seconds]) — a unit test against
# tests/reference/qwen3_ref.py, which it runs with SIMPLER_PYTHON3 (the macros SIMPLER_PYTHON3 and
# SIMPLER_QWEN3_REF); only where that python3 has numpy (SIMPLER_PYTHON3_NUMPY).
function(simpler_qwen3_ref_test name)
  if(NOT SIMPLER_PYTHON3_NUMPY)
    return()
  endif()
  cmake_parse_arguments(ARG "RELEASE_LEG" "TIMEOUT" "SRCS;DEPS" ${ARGN})
  set(release_leg "")
  if(ARG_RELEASE_LEG)
    set(release_leg RELEASE_LEG)
  endif()
  simpler_test(${name} SRCS ${ARG_SRCS} DEPS ${ARG_DEPS} LABELS "unit" TIMEOUT ${ARG_TIMEOUT}
    ${release_leg})
  target_compile_definitions(${name} PRIVATE
    SIMPLER_PYTHON3="${SIMPLER_PYTHON3}"
    SIMPLER_QWEN3_REF="${PROJECT_SOURCE_DIR}/tests/reference/qwen3_ref.py")
endfunction()

# simpler_executable(NAME SRCS ... DEPS ...) — an executable with the project's include folders
# and warnings; the tests, benchmarks and fuzzers are built on it. The CLI's caller skips it in
# test-only (sanitizer) builds.
function(simpler_executable name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(${name} PRIVATE ${SIMPLER_WARNINGS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
endfunction()

# simpler_benchmark(NAME SRCS ... DEPS ...) — a Google Benchmark binary (*_benchmark.cc beside
# the code it times), built with the release flavour, never run by the tests.
function(simpler_benchmark name)
  if(SIMPLER_TESTS_ONLY)
    return()
  endif()
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  simpler_executable(${name} SRCS ${ARG_SRCS}
    DEPS ${ARG_DEPS} benchmark::benchmark benchmark::benchmark_main)
endfunction()

# simpler_fuzzer(NAME SRCS ... DEPS ...) — a libFuzzer target, built only with
# SIMPLER_ENABLE_FUZZING; `fuzzers` builds them all. Seed corpus, dictionary and saved crashes
# live in fuzz/NAME/ beside the source (see scripts/fuzz.sh).
function(simpler_fuzzer name)
  if(NOT SIMPLER_ENABLE_FUZZING)
    return()
  endif()
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  simpler_executable(${name} SRCS ${ARG_SRCS} DEPS ${ARG_DEPS})
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/fuzz)
  if(NOT TARGET fuzzers)
    add_custom_target(fuzzers)
  endif()
  add_dependencies(fuzzers ${name})
endfunction()
