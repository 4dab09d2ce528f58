// attnserve-cli health [SERVICE]
#include <ostream>

#include "client/cli/args.h"
#include "client/cli/commands.h"

namespace attnserve::cli {

int RunHealth(CommandContext& ctx, const std::vector<std::string>& args) {
  FlagParser flags;
  std::vector<std::string> positionals;
  bool help = false;
  std::string error;
  if (!flags.Parse(args, &positionals, &help, &error)) return ctx.UsageError("health", error);
  if (positionals.size() > 1) {
    return ctx.UsageError("health", "unexpected argument '" + positionals[1] + "'");
  }
  const std::string service = positionals.empty() ? "" : positionals[0];
  ServingStatus status = ServingStatus::kUnknown;
  grpc::Status s = ctx.client().HealthStatus(service, &status);
  if (!s.ok()) {
    // An unknown service is an answer, not a transport failure: print it like the others.
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      ctx.out() << ServingStatusName(ServingStatus::kServiceUnknown) << "\n";
      return kExitFailure;
    }
    return ctx.Fail(s);
  }
  ctx.out() << ServingStatusName(status) << "\n";
  return status == ServingStatus::kServing ? kExitOk : kExitFailure;
}

}  // namespace attnserve::cli
