// titan: one binary, many subcommands (see command.h).
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <new>
#include <string>

#include "cli/command.h"
#include "core/cpu_isa.h"
#include "core/error.h"
#include "distributed/runtime.h"

namespace titan::cli {
std::map<std::string, Command>& command_registry() {
  static std::map<std::string, Command> registry;
  return registry;
}
}  // namespace titan::cli

static void print_usage(FILE* out) {
  std::fprintf(out, "usage: titan <command> [args...]\n\ncommands:\n");
  for (const auto& [name, cmd] : titan::cli::command_registry())
    std::fprintf(out, "  %-12s %s\n", name.c_str(), cmd.summary.c_str());
  std::fprintf(out, "\n`titan <command> --help` describes a command.\n");
}

// An exception that is not a titan::Error, in titan's words: a filesystem error starts with the path it
// is about ("out/x: cannot create directories: Not a directory"), an allocation failure says so.
static std::string library_error_text(const std::exception& e) {
  if (const auto* fe = dynamic_cast<const std::filesystem::filesystem_error*>(&e)) {
    // what(): "filesystem error: <operation>: <reason> [<path1>] [<path2>]"
    std::string op = fe->what();
    const std::string tag = "filesystem error: ", reason = fe->code().message();
    if (op.rfind(tag, 0) == 0) op.erase(0, tag.size());
    const size_t cut = op.find(": " + reason);
    if (cut != std::string::npos) op.erase(cut);
    std::string paths = fe->path1().string();
    if (!fe->path2().empty()) paths += " -> " + fe->path2().string();
    return (paths.empty() ? "" : paths + ": ") + op + ": " + reason;
  }
  if (dynamic_cast<const std::bad_alloc*>(&e)) return "out of memory (an allocation failed)";
  return e.what();
}

int main(int argc, char** argv) {
  auto& registry = titan::cli::command_registry();
  if (argc < 2) {
    // With no command, the trainer's embedded default run starts (when the trainer is built in).
    auto it = registry.find("train");
    if (it == registry.end()) {
      print_usage(stderr);
      return 2;
    }
    char* train_argv[] = {const_cast<char*>("train"), nullptr};
    argc = 2;
    argv = train_argv - 1;  // argv[1] == "train"
  }
  const char* name = argv[1];
  if (!std::strcmp(name, "-h") || !std::strcmp(name, "--help") || !std::strcmp(name, "help")) {
    print_usage(stdout);
    return 0;
  }
  auto it = registry.find(name);
  if (it == registry.end()) {
    std::fprintf(stderr, "titan: unknown command '%s'\n", name);
    print_usage(stderr);
    return 2;
  }
  // In a multi-rank job (mpirun/srun/titan run) a failing rank must take the whole job down: the dist
  // hooks print "[rank R] titan <cmd>: error: ..." and MPI_Abort instead of returning while the other
  // ranks wait in a collective; on success they finalize MPI. Alone they change nothing.
  // Past a file-size limit (ulimit -f) a write fails with EFBIG and is reported like a full disk, instead
  // of the default SIGXFSZ ending the process with its files half written.
  std::signal(SIGXFSZ, SIG_IGN);
  try {
    titan::cpu_isa();  // a bad TITAN_CPU_ISA is an error before any work, whatever the command
    return titan::dist::finish_command(name, it->second.fn(argc - 1, argv + 1));
  } catch (const titan::Error& e) {
    titan::dist::report_fatal_error(name, e.what());
    std::fprintf(stderr, "titan %s: error: %s\n", name, e.what());
    return 1;
  } catch (const std::exception& e) {
    const std::string message = library_error_text(e);
    titan::dist::report_fatal_error(name, message.c_str());
    std::fprintf(stderr, "titan %s: error: %s\n", name, message.c_str());
    return 1;
  }
}
