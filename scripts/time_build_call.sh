#!/bin/sh
# A compiler and linker launcher (CMAKE_CXX_COMPILER_LAUNCHER, CMAKE_CXX_LINKER_LAUNCHER) that
# runs the call it is given under GNU time and appends "<user s> <system s> <wall s> <output>"
# to $SIMPLER_CPU_LOG (scripts/build_cpu.sh sets both); without SIMPLER_CPU_LOG it only runs it.
# SIMPLER_TIME_TRACE=1 adds -ftime-trace to clang's compiles: a JSON of where each one's time
# went beside its object (<object>.json; chrome://tracing or scripts/time_trace_summary.py).
if [ -z "${SIMPLER_CPU_LOG:-}" ]; then exec "$@"; fi
out=""
prev=""
compile=0
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  if [ "$a" = "-c" ]; then compile=1; fi
  prev="$a"
done
if [ "${SIMPLER_TIME_TRACE:-0}" = 1 ] && [ $compile = 1 ]; then
  case "$1" in *clang*) set -- "$@" -ftime-trace ;; esac
fi
exec /usr/bin/time -f "%U %S %e ${out:-?}" -a -o "$SIMPLER_CPU_LOG" "$@"
