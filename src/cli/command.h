// Subcommand registry of the `titan` executable. Each src/cli/cmd_*.cpp registers itself with
// TITAN_COMMAND; main() dispatches on argv[1]. Commands are thin: parse flags, call a library
// function, report. They throw titan::Error on bad input; main prints it and exits 1.
#pragma once
#include <map>
#include <string>

namespace titan::cli {

// argv[0] is the subcommand name ("forward"), argv[1..] its arguments.
using CommandFn = int (*)(int argc, char** argv);

struct Command {
  std::string summary;
  CommandFn fn;
};

std::map<std::string, Command>& command_registry();

struct CommandRegistrar {
  CommandRegistrar(const char* name, const char* summary, CommandFn fn) {
    command_registry()[name] = Command{summary, fn};
  }
};

}  // namespace titan::cli

#define TITAN_CONCAT_INNER(a, b) a##b
#define TITAN_CONCAT(a, b) TITAN_CONCAT_INNER(a, b)
#define TITAN_COMMAND(name, summary, fn) \
  static ::titan::cli::CommandRegistrar TITAN_CONCAT(titan_command_, __LINE__)(name, summary, fn)
