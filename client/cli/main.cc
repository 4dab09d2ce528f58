// attnserve-cli: command-line client of an attnserve server. See docs/client.md.
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli/commands.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  attnserve::cli::GlobalEnv env;
  env.target = std::getenv("ATTNSERVE_TARGET");
  env.admin_token = std::getenv("ATTNSERVE_ADMIN_TOKEN");
  const int code = attnserve::cli::RunCli(args, env, std::cout, std::cerr);
  std::cout.flush();
  return code;
}
