// The routing RPCs of attnserve.v1.AttentionService (SetRouting, GetRouting) and the layer
// metrics the service reports on loads: proto ⇄ Router and Layer → Metrics, nothing more.
#include <spdlog/spdlog.h>

#include <cmath>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "server/core/form_table.h"
#include "server/metrics/metrics.h"
#include "server/routing/router.h"
#include "server/service/service.h"
#include "server/service/validation.h"

namespace attnserve {
namespace {

void FillRoutingInfo(const Router& router, v1::RoutingInfo* info) {
  for (const auto& [layer, split] : router.AllRoutes()) {
    v1::Route* route = info->add_routes();
    route->set_layer(layer);
    for (const auto& [target, share] : split) {
      v1::RouteWeight* w = route->add_weights();
      w->set_form(static_cast<v1::Form>(target.form ? FormToWire(*target.form) : kAutoChoice.wire));
      w->set_weight(share);
      if (target.math) w->set_math(std::string(MathName(*target.math)));
    }
  }
  info->set_shadow_rate(router.shadow_rate());
}

// The request's weights as a split (empty: remove the route), errors naming the field.
StatusOr<RouteSplit> SplitOf(const v1::SetRoutingRequest& request) {
  std::vector<std::pair<RouteTarget, double>> weights;
  for (int i = 0; i < request.weights_size(); ++i) {
    const v1::RouteWeight& w = request.weights(i);
    const std::optional<Form> form = FormFromWire(w.form());
    if (!form && w.form() != kAutoChoice.wire) {
      return InvalidArgumentError("weights[" + std::to_string(i) +
                                  "].form: expected " + WireChoiceNames() + ", got " +
                                  v1::Form_Name(w.form()) + " (" + std::to_string(w.form()) + ")");
    }
    std::optional<Math> math;
    if (!w.math().empty()) {
      math = ParseMath(w.math());
      if (!math) {
        return InvalidArgumentError("weights[" + std::to_string(i) + "].math: expected " + std::string(kMathChoices) +
                                    " or nothing (the layer's default), got " + QuoteUntrusted(w.math()));
      }
    }
    weights.emplace_back(RouteTarget(form, math), w.weight());
  }
  if (weights.empty()) return RouteSplit();
  return MakeRouteSplit(weights, "weights");
}

}  // namespace

void ReportLayerMetrics(const Layer& layer, Metrics& metrics) {
  metrics.RemoveLayer(layer.name);
  for (const Variant& v : layer.Variants()) {
    const ResidentForm* resident = layer.Find(v);
    metrics.SetLayerForm(layer.name, v, layer.device, resident->weights().Parameters(), layer.HostBytesOf(v));
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::SetRouting(grpc::CallbackServerContext* context,
                                                           const v1::SetRoutingRequest* request,
                                                           v1::RoutingInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Status status;
  try {
    status = [&]() -> Status {
      ATTNSERVE_RETURN_IF_ERROR(CheckAdmin(*context));
      if (options_.router == nullptr) {
        return FailedPreconditionError("routing: this server was started without a router");
      }
      if (request->layer().empty() && !request->has_shadow_rate()) {
        return InvalidArgumentError("layer: expected a layer name or '*' (or only shadow_rate), got neither");
      }
      if (!request->layer().empty() && request->layer() != kDefaultRoute) {
        ATTNSERVE_RETURN_IF_ERROR(ValidateLayerName(request->layer()));
      }
      if (request->has_shadow_rate() && (!std::isfinite(request->shadow_rate()) || request->shadow_rate() < 0 ||
                                         request->shadow_rate() > 1)) {
        return InvalidArgumentError("shadow_rate: expected a fraction in [0, 1], got " +
                                    std::to_string(request->shadow_rate()));
      }
      if (request->layer().empty() && request->weights_size() > 0) {
        return InvalidArgumentError("layer: expected the layer these " + std::to_string(request->weights_size()) +
                                    " weights are for, got an empty string");
      }
      if (!request->layer().empty() && !options_.routes_file.empty()) {
        return FailedPreconditionError("layer: this server follows the routes file '" + options_.routes_file +
                                       "' (--routes-file): change the routes there (docs/service.md, \"Routes for a "
                                       "fleet\"); SetRouting may only set shadow_rate");
      }
      ATTNSERVE_ASSIGN_OR_RETURN(RouteSplit split, SplitOf(*request));
      // Everything is checked before anything changes: a refused call changes nothing.
      if (!request->layer().empty()) {
        ATTNSERVE_RETURN_IF_ERROR(options_.router->SetRoute(request->layer(), split));
        spdlog::info("route {}: {}", request->layer(), split.empty() ? std::string("removed") : FormatRouteSpec(split));
      }
      if (request->has_shadow_rate()) {
        ATTNSERVE_RETURN_IF_ERROR(options_.router->SetShadowRate(request->shadow_rate()));
        spdlog::info("shadow rate: {}", request->shadow_rate());
      }
      FillRoutingInfo(*options_.router, response);
      return OkStatus();
    }();
  } catch (const std::exception& e) {
    status = InternalError(std::string("SetRouting: ") + e.what());
  }
  reactor->Finish(ToGrpc(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetRouting(grpc::CallbackServerContext* context,
                                                           const v1::GetRoutingRequest* /*request*/,
                                                           v1::RoutingInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  Status status;
  try {
    if (options_.router == nullptr) {
      status = FailedPreconditionError("routing: this server was started without a router");
    } else {
      FillRoutingInfo(*options_.router, response);
    }
  } catch (const std::exception& e) {
    status = InternalError(std::string("GetRouting: ") + e.what());
  }
  reactor->Finish(ToGrpc(status));
  return reactor;
}

}  // namespace attnserve
