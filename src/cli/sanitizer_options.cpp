// Under the sanitizers (the `asan` preset), in every titan process and test executable (CMake adds this
// file to the tests too): LeakSanitizer off, since OpenMPI's and OpenMP's runtimes keep allocations
// (dlopen'd plugins) alive to process exit; an error aborts; UB reports carry a stack trace. Built in
// rather than set in the environment, which ranks started through mpirun do not always inherit and
// which ctest's ENVIRONMENT of gtest-discovered tests can hold only one variable of. ASAN_OPTIONS /
// UBSAN_OPTIONS in the environment still override these.
// GCC says __SANITIZE_ADDRESS__; clang (before 17) only __has_feature(address_sanitizer).
#if defined(__SANITIZE_ADDRESS__)
#define TITAN_ASAN_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TITAN_ASAN_BUILD 1
#endif
#endif
#if defined(TITAN_ASAN_BUILD)
extern "C" const char* __asan_default_options() {
  return "detect_leaks=0:abort_on_error=1";
}
extern "C" const char* __ubsan_default_options() {
  return "print_stacktrace=1:halt_on_error=1";
}
#endif
