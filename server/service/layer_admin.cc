// attnserve.v1's layer admin: LoadLayer on the admin worker (admin_worker.h), UnloadLayer, and
// who may call them (CheckAdmin; docs/security.md).
#include <spdlog/spdlog.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "server/metrics/metrics.h"
#include "server/service/admin_worker.h"
#include "server/service/guarded.h"
#include "server/service/service.h"

namespace attnserve {

bool AttentionServiceImpl::WaitForAdminCalls(std::chrono::steady_clock::time_point until) {
  return admin_->WaitIdle(until);
}

void AttentionServiceImpl::AbandonAdminCalls() { admin_->AbandonAll(); }

grpc::ServerUnaryReactor* AttentionServiceImpl::LoadLayer(grpc::CallbackServerContext* context,
                                                          const v1::LoadLayerRequest* request,
                                                          v1::LayerInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Status status = Guarded("LoadLayer", [&]() -> Status {
    ATTNSERVE_RETURN_IF_ERROR(CheckAdmin(*context));
    // Checked here too (the store checks again) so a bad name does not wait behind a load.
    ATTNSERVE_RETURN_IF_ERROR(ValidateLayerName(request->name()));
    if (request->source().empty()) {
      return InvalidArgumentError(
          "source: expected a SOURCE such as 'random:d_model=64,heads=4' or "
          "'safetensors:PATH', got an empty string");
    }
    // The call is answered once: by the load, or at shutdown by AbandonAdminCalls while the
    // load still runs. The request and response belong to gRPC only until that answer, so
    // the task copies what it reads and fills the response only if it answers.
    auto answered = std::make_shared<std::atomic<bool>>(false);
    AdminWorker::Task task;
    task.deadline = SteadyDeadline(*context);
    task.refuse = [reactor, answered](Status st) {
      if (!answered->exchange(true)) reactor->Finish(ToGrpc(st));
    };
    task.run = [this, reactor, response, answered, name = request->name(), source = request->source()] {
      spdlog::info("loading layer '{}'", name);  // a load can take minutes: say it began
      v1::LayerInfo info;
      Status st = Guarded("LoadLayer", [&]() -> Status {
        ATTNSERVE_ASSIGN_OR_RETURN(std::shared_ptr<const Layer> layer, store_->Load(name, source, LoadOrigin::kApi));
        if (options_.metrics != nullptr) ReportLayerMetrics(*layer, *options_.metrics);
        FillLayerInfo(*layer, &info);
        return OkStatus();
      });
      if (st.ok()) {
        spdlog::info("loaded layer '{}' from '{}'", name, info.source());
      } else {
        spdlog::warn("LoadLayer '{}' refused: {}", name, st.ToString());
      }
      if (answered->exchange(true)) return;  // the server stopped waiting: nobody reads it
      *response = std::move(info);
      reactor->Finish(ToGrpc(st));
    };
    if (!admin_->Post(std::move(task))) {
      return ResourceExhaustedError("admin: " + std::to_string(admin_->capacity()) +
                                    " admin calls are already waiting (--admin-queue); retry later");
    }
    return OkStatus();
  });
  if (!status.ok()) reactor->Finish(ToGrpc(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnloadLayer(grpc::CallbackServerContext* context,
                                                            const v1::UnloadLayerRequest* request,
                                                            v1::UnloadLayerResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Status status = Guarded("UnloadLayer", [&]() -> Status {
    ATTNSERVE_RETURN_IF_ERROR(CheckAdmin(*context));
    // Requests already holding the layer finish on it; the weights go with the last of them.
    Status st = store_->Unload(request->name());
    if (st.ok() && options_.metrics != nullptr) options_.metrics->RemoveLayer(request->name());
    if (st.ok()) spdlog::info("unloaded layer '{}'", request->name());
    return st;
  });
  reactor->Finish(ToGrpc(status));
  return reactor;
}

Status AttentionServiceImpl::CheckAdmin(const grpc::CallbackServerContext& context) const {
  switch (options_.admin_access) {
    case AdminAccess::kOpen:
      return OkStatus();
    case AdminAccess::kClosed:
      return PermissionDeniedError(
          "admin: LoadLayer, UnloadLayer and SetRouting are closed on this listener; start the server with "
          "--admin-token (or ATTNSERVE_ADMIN_TOKEN) and send 'authorization: Bearer TOKEN', or call them through "
          "--admin-listen 127.0.0.1:PORT (docs/security.md)");
    case AdminAccess::kToken:
      break;
  }
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return UnauthenticatedError(
        "authorization: expected metadata 'authorization: Bearer <admin token>' (this server guards "
        "LoadLayer, UnloadLayer and SetRouting), got none");
  }
  const std::string_view got(it->second.data(), it->second.size());
  const std::string want = "Bearer " + options_.admin_token;
  // Compare every byte whatever the first mismatch, so timing does not reveal the token.
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got[i] : 0));
  if (diff != 0) return UnauthenticatedError("authorization: the admin token is not accepted");
  return OkStatus();
}

}  // namespace attnserve
