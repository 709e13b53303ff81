// Test fixture: a shared library that exports no program entry point.
extern "C" __attribute__((visibility("default"))) int not_a_program() { return 42; }
