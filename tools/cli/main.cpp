// sparsefill CLI: prefill, bench, inspect, eval, search, moa-profile.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "common/file_io.h"
#include "tools/cli/cli.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    sf::cli::print_usage(stderr);
    return 2;
  }
  // --help in the command's place, or as the first option (before a bench subcommand): the usage
  // on stdout, exit 0. Later, where an option can stand, parse_args answers it; after a valued
  // option it is that option's value (--prompt -h).
  for (int i = 1; i < argc && i <= 2; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      sf::cli::print_usage(stdout);
      return 0;
    }
  const std::string cmd = argv[1];
  auto dispatch = [&]() -> int {
    if (cmd == "prefill") return sf::cli::cmd_prefill(argc, argv);
    if (cmd == "bench") return sf::cli::cmd_bench(argc, argv);
    if (cmd == "inspect") return sf::cli::cmd_inspect(argc, argv);
    if (cmd == "eval") {
      // KV retention evaluation lives in cmd_retention_eval.cpp.
      for (int i = 2; i < argc; ++i)
        if (!std::strcmp(argv[i], "--retention") || !std::strncmp(argv[i], "--retention=", 12))
          return sf::cli::cmd_retention_eval(argc, argv);
      return sf::cli::cmd_eval(argc, argv);
    }
    if (cmd == "search") return sf::cli::cmd_search(argc, argv);
    if (cmd == "moa-profile") return sf::cli::cmd_moa_profile(argc, argv);
    std::fprintf(stderr, "error: unknown command '%s'\n", cmd.c_str());
    sf::cli::print_usage(stderr);
    return 2;
  };
  int rc = 1;
  try {
    rc = dispatch();
  } catch (const std::exception& e) {  // process edge: nothing escapes as a crash
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  // Some commands' result is what they print (bench prefill without --out).
  return sf::exit_status_after_stdout(rc);
}
