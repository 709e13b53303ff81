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

# LLVM's lld (Debian's lld) links every executable and program library where the compiler
# accepts -fuse-ld=lld: the same 31 links of the ASan build took 16.2 CPU-s with it, 37.8 with
# GNU ld (docs/design/build_time.md).
option(SIMPLER_LLD "Link with LLVM's lld where the compiler accepts -fuse-ld=lld" ON)
if(SIMPLER_LLD)
  include(CheckLinkerFlag)
  check_linker_flag(CXX -fuse-ld=lld SIMPLER_HAVE_LLD)
  if(SIMPLER_HAVE_LLD)
    add_link_options(-fuse-ld=lld)
  endif()
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
  # libFuzzer's coverage (SanitizerCoverage: edge counters, and a callback at every comparison)
  # is compiled only into the code a fuzz target feeds its input to: the libraries marked FUZZED
  # (simpler_library) and the fuzz targets' own sources. In the rest (kernels, runtime, engine,
  # server) it would only slow the unit tests that share this build: a call at every integer
  # comparison of the hot loops. Only the fuzz targets link libFuzzer's main. With ASAN on too
  # (the asan flavour), the unit tests and the fuzz targets share one build.
  set(SIMPLER_FUZZ_COVERAGE -fsanitize=fuzzer-no-link)
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

# Precompiled headers (SIMPLER_PCH, on by default): the standard library, abseil's status and
# strings, nlohmann-json, spdlog and fmt (and GoogleTest for the tests) are parsed, and their
# templates instantiated, once per build rather than once per translation unit. A precompiled
# header is valid only for the flags it was built with (optimisation level, -fPIC vs -fPIE,
# sanitizer, target features), so there is one per kind of translation unit: a library's, an
# executable's and a test's, each built by a small anchor target that the others reuse
# (PRECOMPILE_HEADERS_REUSE_FROM). Sources with their own target flags (the per-ISA matmul files)
# set SKIP_PRECOMPILE_HEADERS. On by default with clang (the sanitizer flavours), whose
# precompiled headers also hold the headers' template instantiations: they cut the CPU time of
# the ThreadSanitizer build from empty by 26% (380 -> 281 s, 2 vCPUs Zen 5, 2026-12-05). g++'s
# did not (release 468 -> 483 s: loading its larger precompiled headers costs what parsing did).
# g++'s precompiled headers also emit the headers' inline functions into targets that do not
# link their libraries (fmt's, in the grammar test), so the option is for clang alone.
option(SIMPLER_PCH "Precompile the third-party headers once per kind of target (clang)" ON)
if(SIMPLER_PCH AND NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  set(SIMPLER_PCH OFF)
endif()
set(SIMPLER_PCH_HEADERS
  <algorithm> <array> <atomic> <chrono> <cmath> <cstdint> <cstring> <deque> <filesystem>
  <fstream> <functional> <limits> <map> <memory> <mutex> <optional> <random> <set> <span>
  <string> <string_view> <thread> <utility> <vector>
  <absl/status/status.h> <absl/status/statusor.h> <absl/strings/str_cat.h>
  <absl/strings/str_format.h> <nlohmann/json.hpp> <spdlog/spdlog.h> <fmt/format.h>)
# Makes `name` use the precompiled headers of `kind` (see above).
function(simpler_use_pch name kind)
  if(SIMPLER_PCH)
    target_precompile_headers(${name} REUSE_FROM simpler_pch_${kind})
  endif()
endfunction()

# simpler_library(NAME SRCS ... DEPS ... [FUZZED])
# FUZZED: a fuzz target feeds its input to this library's code (a parser, a decoder): with
# SIMPLER_ENABLE_FUZZING it is compiled with libFuzzer's coverage (see SIMPLER_FUZZ_COVERAGE).
function(simpler_library name)
  cmake_parse_arguments(ARG "FUZZED" "" "SRCS;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SRCS})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR}/include PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(${name} PRIVATE ${SIMPLER_WARNINGS})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
  if(SIMPLER_ENABLE_FUZZING AND ARG_FUZZED)
    target_compile_options(${name} PRIVATE ${SIMPLER_FUZZ_COVERAGE})
    simpler_use_pch(${name} libfuzz)
  else()
    simpler_use_pch(${name} lib)
  endif()
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
# The precompiled headers of each kind (SIMPLER_PCH, above).
if(SIMPLER_PCH)
  # kind: lib (static libraries: -fPIC, the flavour's -O), exe (the CLI, benchmarks: -fPIE; not
  # in a test-only build, which has none) or test (-fPIE at SIMPLER_TEST_OPT); with
  # SIMPLER_ENABLE_FUZZING also libfuzz, lib with libFuzzer's coverage (clang refuses a
  # precompiled header built with other -fsanitize flags), which the fuzz targets share
  # (simpler_fuzzer compiles them -fPIC for it): each kind costs a build from empty one
  # precompiled header, about 5.5 CPU-s under ASan.
  set(pch_kinds lib test)
  if(NOT SIMPLER_TESTS_ONLY)
    list(APPEND pch_kinds exe)
  endif()
  if(SIMPLER_ENABLE_FUZZING)
    list(APPEND pch_kinds libfuzz)
  endif()
  foreach(kind IN LISTS pch_kinds)
    add_library(simpler_pch_${kind} OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cc)
    target_link_libraries(simpler_pch_${kind} PRIVATE absl::status absl::statusor absl::strings
      absl::str_format spdlog::spdlog fmt::fmt nlohmann_json::nlohmann_json)
    set(headers ${SIMPLER_PCH_HEADERS})
    if(kind STREQUAL "test")
      target_link_libraries(simpler_pch_${kind} PRIVATE GTest::gtest GTest::gmock)
      target_compile_options(simpler_pch_${kind} PRIVATE ${SIMPLER_TEST_OPT})
      list(APPEND headers <gtest/gtest.h> <gmock/gmock.h>)
    endif()
    if(kind STREQUAL "libfuzz")
      target_compile_options(simpler_pch_${kind} PRIVATE ${SIMPLER_FUZZ_COVERAGE})
    endif()
    if(NOT kind MATCHES "^lib")
      set_target_properties(simpler_pch_${kind} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
      target_compile_options(simpler_pch_${kind} PRIVATE -fPIE)
    endif()
    # No timestamp in the precompiled header, so that ccache can cache what uses it (its manual,
    # "Precompiled headers"; scripts/build.sh sets the sloppiness it also asks for).
    target_compile_options(simpler_pch_${kind} PRIVATE "SHELL:-Xclang -fno-pch-timestamp")
    target_precompile_headers(simpler_pch_${kind} PRIVATE ${headers})
  endforeach()
endif()

# simpler_add_to_group(GROUP NAME) — makes the custom target GROUP (created on first use) build
# NAME: `concurrency_tests`, `fuzzers`.
function(simpler_add_to_group group name)
  if(NOT TARGET ${group})
    add_custom_target(${group})
  endif()
  add_dependencies(${group} ${name})
endfunction()

# simpler_test(NAME SRCS ... DEPS ... LABELS ... [TIMEOUT seconds] [RELEASE_LEG] [TSAN_SKIP ...])
# Every test has a time limit so a hang fails fast.
# Each flavour runs the tests that only it can check. The sanitizer flavours (SIMPLER_TESTS_ONLY)
# build and register every test: ASan + UBSan runs the "unit" label, TSan the "concurrency" one.
# A full (release) build registers only the RELEASE_LEG tests, those whose answer depends on the
# optimised code or that a sanitizer makes skip or shrink (the kernels and numerics against their
# references, the fork paths of the hierarchy, the tokenizer's 1 MiB runs), beside the e2e tests
# of the CLI. Its other tests are targets outside `all` (`ninja -C build/release worker_test`
# builds one), and -DSIMPLER_ALL_TESTS=ON builds and registers them all.
function(simpler_test name)
  cmake_parse_arguments(ARG "RELEASE_LEG" "TIMEOUT" "SRCS;DEPS;LABELS;TSAN_SKIP" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  simpler_executable(${name} SRCS ${ARG_SRCS}
    DEPS ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main PCH test)
  target_compile_options(${name} PRIVATE ${SIMPLER_TEST_OPT})
  if(NOT SIMPLER_TESTS_ONLY AND NOT SIMPLER_ALL_TESTS AND NOT ARG_RELEASE_LEG)
    set_target_properties(${name} PROPERTIES EXCLUDE_FROM_ALL TRUE)
    return()
  endif()
  # TSAN_SKIP: GoogleTest names (Suite.Test) that the ThreadSanitizer leg leaves out, those that
  # send one request at a time to check what it answers (they run under ASan + UBSan); the
  # leg's time goes to the tests whose subject is what runs at once.
  set(command ${name})
  if(SIMPLER_ENABLE_TSAN AND ARG_TSAN_SKIP)
    list(JOIN ARG_TSAN_SKIP ":" skipped)
    list(APPEND command --gtest_filter=-${skipped})
  endif()
  add_test(NAME ${name} COMMAND ${command})
  # COST orders a parallel ctest run, longest first, where no earlier run's timings exist (a fresh
  # build folder, as in CI): a long test started last would run alone on one CPU while the other
  # idles. A test's time limit is about 4x its time, so it stands in for it.
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} COST ${ARG_TIMEOUT}
    LABELS "${ARG_LABELS}")
  # `concurrency_tests` builds just what the ThreadSanitizer leg runs.
  if("concurrency" IN_LIST ARG_LABELS)
    simpler_add_to_group(concurrency_tests ${name})
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
  cmake_parse_arguments(ARG "" "PCH" "SRCS;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(${name} PRIVATE ${SIMPLER_WARNINGS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  if(NOT ARG_PCH)
    set(ARG_PCH exe)
  endif()
  simpler_use_pch(${name} ${ARG_PCH})
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
  simpler_executable(${name} SRCS ${ARG_SRCS} DEPS ${ARG_DEPS} PCH libfuzz)
  # -fPIC (the last of -fPIE and -fPIC wins), as the precompiled header it shares with the
  # libraries was built.
  target_compile_options(${name} PRIVATE ${SIMPLER_FUZZ_COVERAGE} -fPIC)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/fuzz)
  simpler_add_to_group(fuzzers ${name})
endfunction()
