#include "train/preemption.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

namespace titan {

namespace {

volatile sig_atomic_t g_signals = 0;
struct sigaction g_old_term, g_old_usr1;

// The handler runs on an alternate signal stack (SA_ONSTACK) in every thread that computes. oneDNN's JIT f32
// GEMM kernels (libdnnl before 3.12: oneDNN issue #4845) point rsp at a heap workspace while they run, and a
// signal frame pushed below that rsp overwrites the heap: a SIGTERM/SIGUSR1 arriving mid-GEMM ended in
// "corrupted size vs. prev_size" aborts. On an alternate stack the kernel writes the frame there instead.
struct AltStack {
  std::unique_ptr<char[]> memory;
  ~AltStack() {
    if (!memory) return;
    stack_t off{};
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);
  }
};

void install_alt_stack() {
  thread_local AltStack alt;
  if (alt.memory) return;
  stack_t current{};
  if (sigaltstack(nullptr, &current) == 0 && !(current.ss_flags & SS_DISABLE)) return;  // one is set already
  const size_t size = std::max<size_t>(SIGSTKSZ, size_t(64) << 10);
  alt.memory.reset(new char[size]);
  stack_t ss{};
  ss.ss_sp = alt.memory.get();
  ss.ss_size = size;
  if (sigaltstack(&ss, nullptr) != 0) alt.memory.reset();
}

void on_signal(int sig) {
  if (g_signals > 0) _exit(128 + sig);  // the second signal: stop now
  g_signals = 1;
  const char* msg = sig == SIGTERM ? "\ntitan: SIGTERM: finishing this step, saving a checkpoint and exiting "
                                     "(signal again to stop at once)\n"
                                   : "\ntitan: SIGUSR1: finishing this step, saving a checkpoint and exiting "
                                     "(signal again to stop at once)\n";
  (void)!write(STDERR_FILENO, msg, std::strlen(msg));
}

}  // namespace

PreemptionGuard::PreemptionGuard() {
  g_signals = 0;
  // This thread and the OpenMP threads (where oneDNN's kernels run) get their alternate stacks.
  install_alt_stack();
#pragma omp parallel
  install_alt_stack();
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_ONSTACK;
  sigaction(SIGTERM, &sa, &g_old_term);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
}

PreemptionGuard::~PreemptionGuard() {
  sigaction(SIGTERM, &g_old_term, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
}

bool PreemptionGuard::requested() const {
  return g_signals > 0;
}

void PreemptionGuard::inject_fault(int64_t step, int rank) {
  const char* env = std::getenv("TITAN_FAULT_INJECT");
  if (!env || std::strncmp(env, "signal:", 7) != 0) return;
  const std::string spec = env + 7;  // <TERM|USR1>[*2]@<step>[:rank<r>]
  const size_t at = spec.find('@');
  if (at == std::string::npos) return;
  std::string name = spec.substr(0, at);
  const bool twice = name.size() > 2 && name.compare(name.size() - 2, 2, "*2") == 0;
  if (twice) name.resize(name.size() - 2);
  const size_t colon = spec.find(':', at);
  const std::string when =
      spec.substr(at + 1, colon == std::string::npos ? std::string::npos : colon - at - 1);
  if (when != std::to_string(step)) return;
  if (colon != std::string::npos && spec.substr(colon + 1) != "rank" + std::to_string(rank)) return;
  std::raise(name == "USR1" ? SIGUSR1 : SIGTERM);
  if (twice) std::raise(name == "USR1" ? SIGUSR1 : SIGTERM);
}

}  // namespace titan
