// Which x86 CPU this process runs on, as CPUID reports it: its vendor and family, for the
// kernels and probes whose best settings differ between CPU families. Sources: CPUID leaf 0
// (EBX: the vendor string's first 4 bytes) and leaf 1 (EAX: the signature), Intel SDM vol. 2A
// "CPUID" and AMD APM vol. 3 "CPUID Fn0000_0001_EAX".
#pragma once

#include <cstdint>

namespace simpler::base {

// The family of a CPUID leaf 1 EAX `signature`: bits 8-11, plus the extended family (bits
// 20-27) where those are Fh — the "cpu family" Linux's /proc/cpuinfo prints (AMD Zen 4 19h = 25,
// Zen 5 1Ah = 26; Intel's Core and Xeon 6).
uint32_t cpu_family_of(uint32_t signature);

// Whether a CPUID leaf 0 EBX is AMD's ("Auth" of "AuthenticAMD").
bool amd_vendor(uint32_t vendor_ebx);

// This CPU's family (cpu_family_of) when its vendor is AMD; 0 for another vendor, a CPU without
// leaf 1, or off x86-64. Read once; thread-safe; never fails.
uint32_t amd_cpu_family();

}  // namespace simpler::base
