// Under AddressSanitizer (the `asan` preset): LeakSanitizer off in every titan process. The test
// environment sets ASAN_OPTIONS=detect_leaks=0, but ranks started through mpirun do not always inherit
// it, and OpenMPI's and OpenMP's runtimes keep allocations (dlopen'd plugins) alive to process exit.
#if defined(__SANITIZE_ADDRESS__)
extern "C" const char* __asan_default_options() {
  return "detect_leaks=0";
}
#endif
