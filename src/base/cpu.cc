#include "simpler/base/cpu.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace simpler::base {

uint32_t cpu_family_of(uint32_t signature) {
  const uint32_t base = (signature >> 8) & 0xf;
  return base == 0xf ? base + ((signature >> 20) & 0xff) : base;
}

bool amd_vendor(uint32_t vendor_ebx) { return vendor_ebx == 0x68747541; }  // "Auth", little-endian

uint32_t amd_cpu_family() {
#if defined(__x86_64__)
  static const uint32_t family = [] {
    unsigned a = 0, vendor = 0, c = 0, d = 0, signature = 0;
    if (__get_cpuid(0, &a, &vendor, &c, &d) == 0 || !amd_vendor(vendor)) return 0u;
    return __get_cpuid(1, &signature, &a, &c, &d) != 0 ? cpu_family_of(signature) : 0u;
  }();
  return family;
#else
  return 0;
#endif
}

}  // namespace simpler::base
