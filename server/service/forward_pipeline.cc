#include "server/service/forward_pipeline.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "server/batching/divergence.h"
#include "server/core/form_cost.h"
#include "server/core/form_table.h"
#include "server/core/forms.h"
#include "server/core/thread_annotations.h"
#include "server/metrics/metrics.h"
#include "server/routing/router.h"
#include "server/routing/shadow.h"
#include "server/service/auto_form.h"
#include "server/service/footprint.h"
#include "server/service/guarded.h"

namespace attnserve {

std::string LoadedNames(const LayerStore& store) {
  std::string names;
  for (const auto& layer : store.List()) names += (names.empty() ? "" : ", ") + layer->name;
  return names.empty() ? "none" : names;
}

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A response's bytes beyond its output tensor's and what it echoes of the request: protobuf's
// tags and lengths, the shape, the form, the timings and up to two divergences, about 120 bytes
// in attnserve.v1 and about 300 in the Open Inference Protocol (named parameters); rounded up.
constexpr int64_t kResponseFraming = 384;

// What one Forward call reports when it is answered: its outcome to the metrics, and, when it
// was served well and sampled for a shadow, a mirror run of `mirror` to the shadow runner.
struct CallReporting {
  Metrics* metrics = nullptr;
  ShadowRunner* shadow = nullptr;
  std::optional<Variant> mirror;
  std::chrono::steady_clock::time_point arrived;
  const Backend* backend = nullptr;  // for the mirror's scratch in its memory reservation
};

int64_t MicrosBetween(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::microseconds>(to - from).count();
}

// The answer's timing fields of a served call whose timeline is complete up to compute_end.
ServedTimings TimingsOf(const CallTimeline& t, const JobTimings& job) {
  return {.decode_us = MicrosBetween(t.arrived, t.submitted),
          .queue_us = job.queue_us,
          .compute_us = job.compute_us,
          .batch_requests = job.batch_requests,
          .encode_us = MicrosBetween(t.compute_end, std::chrono::steady_clock::now())};
}

// The state of one Forward call: its decoded input, where each job writes, and the outcome of
// every job. Shared by the jobs' completions; the last one to finish answers the call.
class ForwardCall {
 public:
  ForwardCall(ForwardDone done, std::unique_ptr<ForwardAnswer> answer, std::shared_ptr<const Layer> layer,
              AttentionRequest decoded, CallReporting reporting, MemoryBudget::Reservation reservation,
              CallGate::Ticket ticket, CallTimeline timeline)
      : done_(std::move(done)),
        answer_(std::move(answer)),
        layer_(std::move(layer)),
        decoded_(std::move(decoded)),
        reporting_(std::move(reporting)),
        reservation_(std::move(reservation)),
        ticket_(std::move(ticket)),
        timeline_(timeline) {}

  // Prepares the output buffers and submits the served variant's job and, for `compare`, one
  // per other form the layer holds in the served math. The call is answered from the last
  // job's completion.
  static void Start(std::shared_ptr<ForwardCall> call, Variant served, bool compare, Executor* executor,
                    const CallControl& control) {
    call->forms_.push_back(served);
    if (compare) {
      for (const Variant& v : call->layer_->Variants()) {
        if (v.math == served.math && v.form != served.form) call->forms_.push_back(v);
      }
    }
    const int64_t elements = call->decoded_.output_elements();
    std::string* bytes =
        call->answer_->OutputBytes(call->decoded_.batch(), call->decoded_.n(), call->decoded_.d_model());
    bytes->resize(elements * sizeof(float));
    call->output_bytes_ = bytes;
    // The backend writes straight into the response's bytes; a string's heap buffer is
    // aligned for float, but check rather than assume.
    if (reinterpret_cast<uintptr_t>(bytes->data()) % alignof(float) == 0) {
      call->served_output_ = reinterpret_cast<float*>(bytes->data());
    } else {
      call->fallback_output_.resize(elements);
      call->served_output_ = call->fallback_output_.data();
    }
    call->compare_outputs_.resize(call->forms_.size() - 1);
    for (auto& o : call->compare_outputs_) o.resize(elements);
    {
      MutexLock lock(call->mu_);  // uncontended: no job exists yet
      call->statuses_.resize(call->forms_.size());
      call->pending_ = static_cast<int>(call->forms_.size());
    }

    // Every job is built before the first is submitted: what allocates may throw, and after
    // a Submit only the jobs' completions may answer the call.
    std::vector<ForwardJob> jobs(call->forms_.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      jobs[i].layer = call->layer_;
      jobs[i].form = call->forms_[i].form;
      jobs[i].math = call->forms_[i].math;
      jobs[i].sequences =
          call->decoded_.Sequences(i == 0 ? call->served_output_ : call->compare_outputs_[i - 1].data());
      jobs[i].enqueued = call->timeline_.arrived;
      jobs[i].deadline = control.deadline;
      // What the probe reads outlives the jobs: the call ends only from their completions.
      jobs[i].cancelled = control.cancelled;
      jobs[i].done = [call, i](Status status, JobTimings timings) { call->JobDone(i, std::move(status), timings); };
    }
    // Before the first Submit: a job may run, and the call end, inside it.
    call->timeline_.submitted = std::chrono::steady_clock::now();
    call.reset();  // the jobs hold the call now; the last completion answers and frees it
    for (ForwardJob& job : jobs) executor->Submit(std::move(job));
  }

 private:
  void JobDone(size_t index, Status status, JobTimings timings) {
    std::vector<Status> statuses;
    JobTimings served_timings;
    {
      MutexLock lock(mu_);
      statuses_[index] = std::move(status);
      if (index == 0) served_timings_ = timings;
      if (--pending_ > 0) return;
      statuses = std::move(statuses_);
      served_timings = served_timings_;
    }
    Finish(statuses, served_timings);
  }

  // Runs once, on the thread of the last job's completion, with every job's status ([0]: the
  // served form's) and the served job's timings.
  void Finish(const std::vector<Status>& statuses, const JobTimings& served_timings) {
    if (!statuses[0].ok()) {
      Answer(statuses[0]);
      return;
    }
    for (size_t i = 1; i < statuses.size(); ++i) {
      if (!statuses[i].ok()) {
        // The client asked for the comparison; an answer without it would look like agreement.
        Answer(Status(statuses[i].code(),
                      "compare (" + std::string(FormName(forms_[i].form)) + " form): " + statuses[i].message()));
        return;
      }
    }
    const size_t elements = static_cast<size_t>(decoded_.output_elements());
    const std::span<const float> served(served_output_, elements);
    // The inputs were finite (DecodeForward); a NaN or an infinity here means float32
    // overflowed in the computation, which the client must hear rather than read as an answer.
    // One pass over the output: cheap next to computing it.
    if (Status finite = CheckOutputFinite(decoded_, forms_[0].form, served); !finite.ok()) {
      if (reporting_.metrics != nullptr) reporting_.metrics->CountNonFiniteOutput(layer_->name, forms_[0]);
      Answer(finite);
      return;
    }
    if (!fallback_output_.empty()) {
      std::memcpy(output_bytes_->data(), fallback_output_.data(), elements * sizeof(float));
    }
    std::vector<FormDivergence> divergences;
    for (size_t i = 1; i < forms_.size(); ++i) {
      const DivergenceStats d = MeasureDivergence(served, compare_outputs_[i - 1]);
      // The served output is finite, so an infinite divergence is a non-finite compare output:
      // the client sees it as such, and it is counted like a served one.
      if (std::isinf(d.max_abs) && reporting_.metrics != nullptr) {
        reporting_.metrics->CountNonFiniteOutput(layer_->name, forms_[i]);
      }
      divergences.push_back({.form = forms_[i].form, .stats = d});
    }
    timeline_.compute_start = served_timings.compute_start;
    timeline_.compute_end = served_timings.compute_end;
    answer_->Served(forms_[0], TimingsOf(timeline_, served_timings), divergences);
    OfferShadow(served);
    timeline_.answered = std::chrono::steady_clock::now();
    Answer(OkStatus(), &timeline_);
  }

  // Every answer goes through here, so that each call is counted exactly once.
  void Answer(const Status& status, const CallTimeline* served = nullptr) {
    if (reporting_.metrics != nullptr) {
      reporting_.metrics->RequestFinished(layer_->name, forms_[0], status.code(), SecondsSince(reporting_.arrived));
    }
    done_(status, served);
    ticket_.Release();  // answered: the drain no longer waits for this call
  }

  // Queues the mirror run, copying the request and the served output now: both belong to the
  // call, which ends with the answer. A full shadow queue drops the mirror, never the answer.
  void OfferShadow(std::span<const float> served) {
    if (reporting_.shadow == nullptr || !reporting_.mirror) return;
    const std::vector<SequenceShape> shapes = ShapesOf(decoded_);
    const int64_t bytes =
        ShadowRequest::BytesFor(decoded_) + JobBytes(*layer_, reporting_.mirror->form, decoded_, shapes, reporting_.backend);
    reporting_.shadow->Offer(layer_->name, bytes, [&] {
      ShadowRequest r;
      r.layer = layer_;
      r.served = forms_[0];
      r.mirror = *reporting_.mirror;
      r.request = decoded_;  // a copy: every field, every value owned
      r.served_output.assign(served.begin(), served.end());
      return r;
    });
  }

  const ForwardDone done_;                       // ends the call in its protocol
  const std::unique_ptr<ForwardAnswer> answer_;  // writes the protocol's response
  std::string* output_bytes_ = nullptr;          // the served output in that response
  const std::shared_ptr<const Layer> layer_;     // keeps the weights alive for every job
  const AttentionRequest decoded_;               // may view the request message, which outlives the call
  const CallReporting reporting_;
  // The call's share of the memory budget, given back when the call object goes (after the
  // answer, once the last job's completion lets go of it).
  MemoryBudget::Reservation reservation_;
  CallGate::Ticket ticket_;  // the call counts as open for the drain until it is answered
  CallTimeline timeline_;    // arrived … decoded from StartForward; the rest as the call goes
  std::vector<Variant> forms_;  // [0]: the served variant; the rest: compared against it
  float* served_output_ = nullptr;
  std::vector<float> fallback_output_;
  std::vector<std::vector<float>> compare_outputs_;

  Mutex mu_;
  std::vector<Status> statuses_ ATTNSERVE_GUARDED_BY(mu_);  // each job's, as they complete
  JobTimings served_timings_ ATTNSERVE_GUARDED_BY(mu_);
  int pending_ ATTNSERVE_GUARDED_BY(mu_) = 0;  // jobs not yet complete
};

}  // namespace

ForwardPipeline::ForwardPipeline(LayerStore* store, Executor* executor, ForwardPipelineOptions options)
    : store_(store), executor_(executor), options_(std::move(options)) {}

void ForwardPipeline::Start(const WireForwardRequest& request, std::unique_ptr<ForwardAnswer> answer, ForwardDone done,
                            CallControl control, std::chrono::steady_clock::time_point arrived, const Status& refused) {
  if (options_.metrics != nullptr) options_.metrics->RequestStarted();
  // What a refusal is counted under: a loaded layer's name only (a client-chosen name would
  // make a new series per typo), the form once known, in the math once known.
  std::shared_ptr<const Layer> counted_layer;
  std::optional<Form> counted_form = FormFromWire(request.form);
  Math counted_math = Math::kFp32;
  auto counted = [&]() -> std::optional<Variant> {
    return counted_form ? std::optional<Variant>(Variant{*counted_form, counted_math}) : std::nullopt;
  };
  // Released when this function returns unless the call is started (then at its answer).
  CallGate::Ticket ticket = gate_.Enter();
  CallTimeline timeline;
  timeline.arrived = arrived;
  Status status = Guarded("Forward", [&]() -> Status {
    if (!ticket) {
      return UnavailableError("the server is draining (shutting down): send this request to another replica");
    }
    ATTNSERVE_RETURN_IF_ERROR(CheckWireForm(request.form));
    if (request.layer.empty()) {
      return InvalidArgumentError("layer: expected a layer name, got an empty string (loaded: " + LoadedNames(*store_) +
                                  ")");
    }
    std::shared_ptr<const Layer> layer = store_->Get(request.layer);
    if (layer == nullptr) {
      return NotFoundError("layer: no layer named " + QuoteUntrusted(request.layer) +
                           " is loaded (loaded: " + LoadedNames(*store_) + ")");
    }
    counted_layer = layer;
    counted_math = layer->default_math();
    // The protocol's own conversion refused the request: counted like a decode error.
    if (!refused.ok()) return refused;
    ATTNSERVE_ASSIGN_OR_RETURN(const std::optional<Math> asked_math, ChooseMath(request.math, *layer));
    Math math = asked_math.value_or(layer->default_math());
    counted_math = math;
    // The variants a route may pick: every one held, or those in the math the request named.
    std::vector<Variant> held = layer->Variants();
    std::erase_if(held, [&](const Variant& v) { return asked_math && v.math != *asked_math; });
    // FORM_UNSPECIFIED: the router's split for this layer (sticky on the request key).
    // FORM_AUTO, or a route to auto (nullopt here), is resolved once the shapes are decoded.
    std::optional<Form> chosen;
    if (request.form == static_cast<int>(WireForm::kUnspecified) && options_.router != nullptr) {
      const RouteTarget target = options_.router->Choose(layer->name, held, math, request.request_key);
      chosen = target.form;
      math = target.math.value_or(math);
    } else if (request.form != kAutoChoice.wire) {
      ATTNSERVE_ASSIGN_OR_RETURN(chosen, ChooseForm(request.form, *layer));
    }
    counted_form = chosen;
    counted_math = math;
    timeline.routed = std::chrono::steady_clock::now();

    ATTNSERVE_ASSIGN_OR_RETURN(
        DecodedForward decoded,
        DecodeForward(layer->config, request, ForwardLimits{.max_request_scores = options_.max_request_scores}));
    if (!chosen) {
      chosen = ResolveAuto(layer, ShapesOf(decoded));
      counted_form = chosen;
      if (options_.metrics != nullptr) options_.metrics->CountAutoChoice(layer->name, {*chosen, math});
    }
    const Form form = *chosen;
    timeline.decoded = std::chrono::steady_clock::now();

    // A response gRPC would refuse to send is refused before it is computed.
    const int64_t response_bytes =
        decoded.output_elements() * static_cast<int64_t>(sizeof(float)) + kResponseFraming + request.echoed_bytes;
    if (response_bytes > options_.max_response_bytes) {
      return ResourceExhaustedError("output: [" + std::to_string(decoded.batch()) + ", " + std::to_string(decoded.n()) +
                                    ", " + std::to_string(decoded.d_model()) + "] float32 takes " +
                                    std::to_string(response_bytes) +
                                    " bytes, more than the largest response (--max-message-mb, " +
                                    std::to_string(options_.max_response_bytes) + " bytes); send fewer rows");
    }
    // Admission: the call's whole footprint, or a refusal now (nothing allocated yet).
    MemoryBudget::Reservation reservation;
    if (options_.memory != nullptr) {
      std::vector<Form> forms = {form};
      if (request.compare) {
        for (const auto& [f, _] : layer->forms) {
          if (f != form) forms.push_back(f);
        }
      }
      const int64_t wire_bytes = static_cast<int64_t>(request.input.data.size() + request.context.data.size());
      ATTNSERVE_ASSIGN_OR_RETURN(
          reservation, options_.memory->Reserve(RequestFootprint(*layer, decoded, forms, wire_bytes, options_.backend),
                                                "this request"));
    }

    // Admitted, so served: its key rows count towards a live calibration (before the call owns
    // the decoded tensors).
    if (layer->live_calibration != nullptr && layer->live_calibration->wants_offers()) {
      OfferCalibrationRows(layer, decoded);
    }
    CallReporting reporting{.metrics = options_.metrics,
                            .shadow = options_.shadow,
                            .mirror = std::nullopt,
                            .arrived = arrived,
                            .backend = options_.backend};
    // `compare` already runs every other form; a shadow of it would measure nothing new.
    if (options_.shadow != nullptr && options_.router != nullptr && !request.compare) {
      reporting.mirror = options_.router->ShadowMirror(layer->Variants(), {form, math});
    }
    // A copy of `done`: if building the call throws, the original still ends it below.
    auto call = std::make_shared<ForwardCall>(done, std::move(answer), layer, std::move(decoded), std::move(reporting),
                                              std::move(reservation), std::move(ticket), timeline);
    ForwardCall::Start(std::move(call), {form, math}, request.compare, executor_, control);
    return OkStatus();
  });
  // Once Start has run, the jobs' completions answer the call; only earlier errors end here.
  if (!status.ok()) {
    spdlog::debug("Forward layer={}: {}", QuoteUntrusted(request.layer), status.ToString());
    if (options_.metrics != nullptr) {
      options_.metrics->RequestFinished(counted_layer ? std::string_view(counted_layer->name) : std::string_view(),
                                        counted(), status.code(), SecondsSince(arrived));
    }
    done(status, nullptr);
  }
}

Form ForwardPipeline::ResolveAuto(const std::shared_ptr<const Layer>& layer,
                                  std::span<const SequenceShape> shapes) const {
  if (options_.auto_form != nullptr) return options_.auto_form->Choose(layer, shapes).form;
  const ResidentForm* summed = layer->Find(Form::kSummed);
  return ChooseExactForm(FlopCountModel(), layer->Find(Form::kFactored)->weights(),
                         summed != nullptr ? &summed->weights() : nullptr, shapes,
                         options_.backend != nullptr ? options_.backend->summed_order() : SummedOrder{})
      .form;
}

void ForwardPipeline::OfferCalibrationRows(const std::shared_ptr<const Layer>& layer,
                                           const DecodedForward& decoded) const {
  LiveCalibration& live = *layer->live_calibration;
  if (!live.Offer(decoded)) return;
  spdlog::info("layer '{}': {} live calibration rows are in; building its low-rank form ({})", layer->name,
               live.rows_wanted(), layer->lowrank_selection);
  if (!options_.build_live_calibration) return;
  if (!options_.build_live_calibration(layer)) {
    live.Unclaim();
    spdlog::warn("layer '{}': the low-rank form's build could not start now; the next call retries", layer->name);
  }
}

void ForwardPipeline::ReportStages(const CallTimeline& t, std::chrono::steady_clock::time_point done) const {
  if (options_.metrics != nullptr) {
    auto seconds = [](auto from, auto to) { return std::chrono::duration<double>(to - from).count(); };
    // Indexed like kAllServingStages: route, decode, admit, queue, compute, encode, send. A job
    // that ran on the receiving thread started before `submitted` was read back: queue 0.
    const double stages[] = {seconds(t.arrived, t.routed),
                             seconds(t.routed, t.decoded),
                             seconds(t.decoded, t.submitted),
                             std::max(0.0, seconds(t.submitted, t.compute_start)),
                             seconds(t.compute_start, t.compute_end),
                             seconds(t.compute_end, t.answered),
                             seconds(t.answered, done)};
    options_.metrics->StagesServed(stages);
  }
}

}  // namespace attnserve
