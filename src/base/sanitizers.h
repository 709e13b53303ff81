// Which sanitizer this translation unit is built under, the same under g++ (which defines
// __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__) and clang (which reports them through
// __has_feature): SIMPLER_ASAN and SIMPLER_TSAN are 1 or 0, and SIMPLER_SANITIZED is 1 under
// either. Tests use them to shrink their heaviest loops (sanitized code runs 5-20x slower) and to
// know that ThreadSanitizer's runtime keeps a thread of its own (no fork() there).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define SIMPLER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SIMPLER_ASAN 1
#endif
#endif
#ifndef SIMPLER_ASAN
#define SIMPLER_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__)
#define SIMPLER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SIMPLER_TSAN 1
#endif
#endif
#ifndef SIMPLER_TSAN
#define SIMPLER_TSAN 0
#endif

#define SIMPLER_SANITIZED (SIMPLER_ASAN || SIMPLER_TSAN)
