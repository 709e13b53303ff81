#include "simpler/base/cpu.h"

#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

// Signatures (leaf 1 EAX: stepping 3:0, model 7:4, family 11:8, extended model 19:16, extended
// family 27:20) of known CPUs, and what the extension is added to.
TEST(Cpu, FamilyOfASignatureAddsTheExtendedFamilyOnlyToFh) {
  EXPECT_EQ(cpu_family_of(0x00B00F21), 0x1Au);  // AMD Zen 5, model 2
  EXPECT_EQ(cpu_family_of(0x00B40F40), 0x1Au);  // Zen 5, model 44h
  EXPECT_EQ(cpu_family_of(0x00A10F11), 0x19u);  // Zen 4
  EXPECT_EQ(cpu_family_of(0x00000F21), 0xFu);   // family Fh, no extension
  EXPECT_EQ(cpu_family_of(0x00B00A21), 0xAu);   // base Ah: its extended bits are not added
  EXPECT_EQ(cpu_family_of(0x000C06F2), 6u);     // Intel Emerald Rapids
}

TEST(Cpu, AmdVendorIsTheFirstFourBytesOfAuthenticAmd) {
  EXPECT_TRUE(amd_vendor(0x68747541));   // "Auth"
  EXPECT_FALSE(amd_vendor(0x756e6547));  // "Genu" (GenuineIntel)
  EXPECT_FALSE(amd_vendor(0));
}

// amd_cpu_family is this CPU's CPUID as the kernel reports it in /proc/cpuinfo ("vendor_id",
// "cpu family" in decimal).
TEST(Cpu, AmdCpuFamilyIsTheVendorAndFamilyProcCpuinfoNames) {
#if defined(__x86_64__)
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, vendor, family;
  while (std::getline(cpuinfo, line) && (vendor.empty() || family.empty())) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (vendor.empty() && line.rfind("vendor_id", 0) == 0) vendor = value;
    if (family.empty() && line.rfind("cpu family", 0) == 0) family = value;
  }
  if (vendor.empty() || family.empty()) GTEST_SKIP() << "/proc/cpuinfo names no vendor or family";
  EXPECT_EQ(amd_cpu_family(), vendor == "AuthenticAMD" ? std::stoul(family) : 0u)
      << vendor << " family " << family;
#else
  EXPECT_EQ(amd_cpu_family(), 0u);
#endif
}

}  // namespace
}  // namespace simpler::base
