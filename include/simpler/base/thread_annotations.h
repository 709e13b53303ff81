// Clang thread-safety attribute macros. g++ ignores them; a clang build with
// -Wthread-safety checks them.
#pragma once

#if defined(__clang__)
#define SIMPLER_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define SIMPLER_THREAD_ANNOTATION(x)
#endif

#define SIMPLER_CAPABILITY(x) SIMPLER_THREAD_ANNOTATION(capability(x))
#define SIMPLER_SCOPED_CAPABILITY SIMPLER_THREAD_ANNOTATION(scoped_lockable)
#define SIMPLER_GUARDED_BY(x) SIMPLER_THREAD_ANNOTATION(guarded_by(x))
#define SIMPLER_PT_GUARDED_BY(x) SIMPLER_THREAD_ANNOTATION(pt_guarded_by(x))
#define SIMPLER_REQUIRES(...) SIMPLER_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define SIMPLER_EXCLUDES(...) SIMPLER_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define SIMPLER_ACQUIRE(...) SIMPLER_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define SIMPLER_RELEASE(...) SIMPLER_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define SIMPLER_TRY_ACQUIRE(...) SIMPLER_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define SIMPLER_NO_THREAD_SAFETY_ANALYSIS SIMPLER_THREAD_ANNOTATION(no_thread_safety_analysis)
