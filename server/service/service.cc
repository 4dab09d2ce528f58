
#include "server/batching/divergence.h"
#include "server/core/forms.h"
#include "server/core/thread_annotations.h"
#include "server/metrics/metrics.h"
#include "server/routing/router.h"
#include "server/routing/shadow.h"
#include "server/service/footprint.h"
#include "server/service/service.h"
#include "server/service/spectrum_proto.h"
#include "server/service/validation.h"
#include "server/service/wire_request.h"
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <spdlog/spdlog.h>
#include <thread>
#include <utility>
#include <vector>

namespace attnserve {

// validation.h speaks the wire's numbers without including the proto; they must agree (the
// forms' own: tests/unit/form_table_test.cc).
static_assert(static_cast<int>(WireDtype::kFloat32) == v1::DATA_TYPE_FLOAT32);
static_assert(static_cast<int>(WireDtype::kFloat16) == v1::DATA_TYPE_FLOAT16);
static_assert(static_cast<int>(WireDtype::kBFloat16) == v1::DATA_TYPE_BFLOAT16);
static_assert(static_cast<int>(WireForm::kUnspecified) == v1::FORM_UNSPECIFIED);
// attnserve::StatusCode has gRPC's numbers, so conversion is a cast.
static_assert(static_cast<int>(StatusCode::kInvalidArgument) == grpc::StatusCode::INVALID_ARGUMENT);
static_assert(static_cast<int>(StatusCode::kResourceExhausted) == grpc::StatusCode::RESOURCE_EXHAUSTED);
static_assert(static_cast<int>(StatusCode::kUnauthenticated) == grpc::StatusCode::UNAUTHENTICATED);

// One thread that runs admin tasks in order. A layer load reads files and materialises forms
// (seconds for a large layer); doing that on a gRPC callback thread would stall other calls.
// The queue is bounded, a task whose caller's deadline passed while it waited is not run, and
// tasks still waiting at shutdown are answered UNAVAILABLE, so a slow load never holds up a
// drain by more than itself.
class AdminWorker {
 public:
  struct Task {
    std::function<void()> run;
    std::function<void(Status)> refuse;  // answers the call without running it
    std::chrono::steady_clock::time_point deadline;
  };

  explicit AdminWorker(int capacity) : capacity_(capacity), thread_([this] { Run(); }) {}
  ~AdminWorker() {
    std::deque<Task> left;
    {
      MutexLock lock(mu_);
      stopping_ = true;
      left.swap(tasks_);
    }
    cv_.notify_one();
    for (Task& task : left) task.refuse(UnavailableError("the server is shutting down"));
    thread_.join();
  }
  // False when the queue is full (the caller answers RESOURCE_EXHAUSTED).
  bool Post(Task task) {
    {
      MutexLock lock(mu_);
      if (stopping_ || static_cast<int>(tasks_.size()) >= capacity_) return false;
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
    return true;
  }
  int capacity() const { return capacity_; }

  // Answers every waiting task and the running one UNAVAILABLE (the running one goes on, but
  // its answer is dropped): at shutdown, so that gRPC's Wait does not wait for a slow load.
  void AbandonAll() {
    std::deque<Task> waiting;
    std::function<void(Status)> running;
    {
      MutexLock lock(mu_);
      waiting.swap(tasks_);
      running = running_refuse_;
    }
    const Status shutting_down = UnavailableError("the server is shutting down");
    for (Task& task : waiting) task.refuse(shutting_down);
    if (running) running(shutting_down);
    idle_cv_.notify_all();
  }

  // Waits until no task runs or waits, or until `until`; false when one still runs then.
  bool WaitIdle(std::chrono::steady_clock::time_point until) {
    MutexLock lock(mu_);
    return idle_cv_.wait_until(lock.native(), until, [this] {
      mu_.AssertHeld();  // the wait runs its predicate under the lock
      return tasks_.empty() && !running_;
    });
  }

 private:
  void Run() {
    for (;;) {
      Task task;
      {
        MutexLock lock(mu_);
        cv_.wait(lock.native(), [this] {
          mu_.AssertHeld();  // the wait runs its predicate under the lock
          return stopping_ || !tasks_.empty();
        });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
        running_ = true;
        running_refuse_ = task.refuse;
      }
      if (std::chrono::steady_clock::now() >= task.deadline) {
        task.refuse(Status(StatusCode::kDeadlineExceeded, "the deadline passed while the call waited for earlier admin calls"));
      } else {
        task.run();
      }
      {
        MutexLock lock(mu_);
        running_ = false;
        running_refuse_ = nullptr;
      }
      idle_cv_.notify_all();
    }
  }

  const int capacity_;
  Mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Task> tasks_ ATTNSERVE_GUARDED_BY(mu_);
  bool running_ ATTNSERVE_GUARDED_BY(mu_) = false;  // a task is running
  std::function<void(Status)> running_refuse_ ATTNSERVE_GUARDED_BY(mu_);  // the running task's refuse
  bool stopping_ ATTNSERVE_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

namespace {

v1::Form ToProtoForm(Form form) { return static_cast<v1::Form>(FormToWire(form)); }

std::string LoadedNames(const LayerStore& store) {
  std::string names;
  for (const auto& layer : store.List()) names += (names.empty() ? "" : ", ") + layer->name;
  return names.empty() ? "none" : names;
}

// The client's deadline on the steady clock the batcher uses (max when there is none).
std::chrono::steady_clock::time_point SteadyDeadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return std::chrono::steady_clock::time_point::max();
  const auto left = deadline - std::chrono::system_clock::now();
  return std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(left);
}

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
  std::optional<Form> mirror;
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
  ForwardCall(ForwardReactor* reactor, std::unique_ptr<ForwardAnswer> answer, std::shared_ptr<const Layer> layer,
              AttentionRequest decoded, CallReporting reporting, MemoryBudget::Reservation reservation,
              CallGate::Ticket ticket, CallTimeline timeline)
      : reactor_(reactor),
        answer_(std::move(answer)),
        layer_(std::move(layer)),
        decoded_(std::move(decoded)),
        reporting_(std::move(reporting)),
        reservation_(std::move(reservation)),
        ticket_(std::move(ticket)),
        timeline_(timeline) {}

  // Prepares the output buffers and submits the served form's job and, for `compare`, one per
  // other held form. The call is answered from the last job's completion.
  static void Start(std::shared_ptr<ForwardCall> call, Form served, bool compare, Executor* executor,
                    grpc::CallbackServerContext* context) {
    call->forms_.push_back(served);
    if (compare) {
      for (const auto& [form, _] : call->layer_->forms) {
        if (form != served) call->forms_.push_back(form);
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
      jobs[i].form = call->forms_[i];
      jobs[i].sequences =
          call->decoded_.Sequences(i == 0 ? call->served_output_ : call->compare_outputs_[i - 1].data());
      jobs[i].enqueued = call->timeline_.arrived;
      jobs[i].deadline = SteadyDeadline(*context);
      // The context outlives the jobs: the call is finished only from their completions.
      jobs[i].cancelled = [context] { return context->IsCancelled(); };
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
      Answer(ToGrpc(statuses[0]));
      return;
    }
    for (size_t i = 1; i < statuses.size(); ++i) {
      if (!statuses[i].ok()) {
        // The client asked for the comparison; an answer without it would look like agreement.
        Answer(
            grpc::Status(static_cast<grpc::StatusCode>(statuses[i].code()),
                         "compare (" + std::string(FormName(forms_[i])) + " form): " + statuses[i].message()));
        return;
      }
    }
    const size_t elements = static_cast<size_t>(decoded_.output_elements());
    const std::span<const float> served(served_output_, elements);
    // The inputs were finite (DecodeForward); a NaN or an infinity here means float32
    // overflowed in the computation, which the client must hear rather than read as an answer.
    // One pass over the output: cheap next to computing it.
    if (Status finite = CheckOutputFinite(decoded_, forms_[0], served); !finite.ok()) {
      if (reporting_.metrics != nullptr) reporting_.metrics->CountNonFiniteOutput(layer_->name, forms_[0]);
      Answer(ToGrpc(finite));
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
      divergences.push_back({.form = forms_[i], .stats = d});
    }
    timeline_.compute_start = served_timings.compute_start;
    timeline_.compute_end = served_timings.compute_end;
    answer_->Served(forms_[0], TimingsOf(timeline_, served_timings), divergences);
    OfferShadow(served);
    timeline_.answered = std::chrono::steady_clock::now();
    reactor_->Served(timeline_);
    Answer(grpc::Status::OK);
  }

  // Every answer goes through here, so that each call is counted exactly once.
  void Answer(const grpc::Status& status) {
    if (reporting_.metrics != nullptr) {
      reporting_.metrics->RequestFinished(layer_->name, forms_[0], static_cast<StatusCode>(status.error_code()),
                                          SecondsSince(reporting_.arrived));
    }
    reactor_->Finish(status);
    ticket_.Release();  // answered: the drain no longer waits for this call
  }

  // Queues the mirror run, copying the request and the served output now: both belong to the
  // call, which ends with the answer. A full shadow queue drops the mirror, never the answer.
  void OfferShadow(std::span<const float> served) {
    if (reporting_.shadow == nullptr || !reporting_.mirror) return;
    const std::vector<SequenceShape> shapes = ShapesOf(decoded_);
    const int64_t bytes =
        ShadowRequest::BytesFor(decoded_) + JobBytes(*layer_, *reporting_.mirror, decoded_, shapes, reporting_.backend);
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

  ForwardReactor* const reactor_;
  const std::unique_ptr<ForwardAnswer> answer_;  // writes the protocol's response
  std::string* output_bytes_ = nullptr;         // the served output in that response
  const std::shared_ptr<const Layer> layer_;  // keeps the weights alive for every job
  const AttentionRequest decoded_;  // may view the request message, which outlives the call
  const CallReporting reporting_;
  // The call's share of the memory budget, given back when the call object goes (after the
  // answer, once the last job's completion lets go of it).
  MemoryBudget::Reservation reservation_;
  CallGate::Ticket ticket_;  // the call counts as open for the drain until it is answered
  CallTimeline timeline_;    // arrived … decoded from StartForward; the rest as the call goes
  std::vector<Form> forms_;  // [0]: the served form; the rest: compared against it
  float* served_output_ = nullptr;
  std::vector<float> fallback_output_;
  std::vector<std::vector<float>> compare_outputs_;

  Mutex mu_;
  std::vector<Status> statuses_ ATTNSERVE_GUARDED_BY(mu_);  // each job's, as they complete
  JobTimings served_timings_ ATTNSERVE_GUARDED_BY(mu_);
  int pending_ ATTNSERVE_GUARDED_BY(mu_) = 0;               // jobs not yet complete
};

// Runs `body` and turns anything it throws into INTERNAL (or RESOURCE_EXHAUSTED for memory):
// no exception crosses the service boundary.
template <typename Body>
Status Guarded(const char* what, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    spdlog::error("{}: unexpected exception: {}", what, e.what());
    return InternalError(std::string(what) + ": " + e.what());
  } catch (...) {
    spdlog::error("{}: unexpected exception", what);
    return InternalError(std::string(what) + ": unexpected exception");
  }
}

}  // namespace

void FillLayerInfo(const Layer& layer, v1::LayerInfo* info) {
  info->set_name(layer.name);
  info->set_source(layer.source);
  v1::LayerConfig* c = info->mutable_config();
  c->set_d_model(layer.config.d_model);
  c->set_heads(layer.config.heads);
  c->set_kv_heads(layer.config.kv_heads);
  c->set_d_head(layer.config.d_head);
  c->set_bias(layer.config.bias);
  c->set_scale(layer.config.SoftmaxScale());
  for (const auto& [form, resident] : layer.forms) {
    const FormWeights& w = resident->weights();
    v1::FormInfo* f = info->add_forms();
    f->set_form(ToProtoForm(form));
    f->set_parameters(w.Parameters());
    f->set_bytes(resident->HostBytes());
    f->set_device(layer.device);
    const SequenceShape shape{kFlopsReferenceLength, kFlopsReferenceLength, -1};
    f->set_flops_per_token(ForwardFlops(w, std::span<const SequenceShape>(&shape, 1)) /
                           static_cast<double>(kFlopsReferenceLength));
    f->set_flops_reference_length(kFlopsReferenceLength);
  }
  FillLowRankInfo(layer, info);
}

void ForwardReactor::OnDone() {
  if (served_ && metrics_ != nullptr) {
    const CallTimeline& t = *served_;
    const auto done = std::chrono::steady_clock::now();
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
    metrics_->StagesServed(stages);
  }
  delete this;
}

AttentionServiceImpl::AttentionServiceImpl(LayerStore* store, Executor* executor, ServiceOptions options)
    : store_(store), executor_(executor), options_(std::move(options)), admin_(std::make_unique<AdminWorker>(options_.admin_queue)) {}

AttentionServiceImpl::~AttentionServiceImpl() = default;

bool AttentionServiceImpl::WaitForAdminCalls(std::chrono::steady_clock::time_point until) {
  return admin_->WaitIdle(until);
}

void AttentionServiceImpl::AbandonAdminCalls() { admin_->AbandonAll(); }

namespace {

// attnserve.v1's answer: the output tensor and the timings as ForwardResponse's fields.
class V1ForwardAnswer final : public ForwardAnswer {
 public:
  explicit V1ForwardAnswer(v1::ForwardResponse* response) : response_(response) {}

  std::string* OutputBytes(int64_t batch, int64_t n, int64_t d_model) override {
    v1::Tensor* out = response_->mutable_output();
    out->set_dtype(v1::DATA_TYPE_FLOAT32);
    out->add_shape(batch);
    out->add_shape(n);
    out->add_shape(d_model);
    return out->mutable_data();
  }

  void Served(Form form, const ServedTimings& timings, std::span<const FormDivergence> divergences) override {
    for (const FormDivergence& d : divergences) {
      v1::Divergence* div = response_->add_divergence();
      div->set_form(ToProtoForm(d.form));
      div->set_max_abs(d.stats.max_abs);
      div->set_rel_l2(d.stats.rel_l2);
    }
    response_->set_form(ToProtoForm(form));
    response_->set_queue_us(timings.queue_us);
    response_->set_compute_us(timings.compute_us);
    response_->set_batch_requests(timings.batch_requests);
    response_->set_decode_us(timings.decode_us);
    response_->set_encode_us(timings.encode_us);
  }

 private:
  v1::ForwardResponse* const response_;
};

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                        const v1::ForwardRequest* request,
                                                        v1::ForwardResponse* response) {
  const auto arrived = std::chrono::steady_clock::now();
  auto* reactor = NewForwardReactor();
  std::unique_ptr<ForwardAnswer> answer;
  Status made = Guarded("Forward", [&]() -> Status {
    answer = std::make_unique<V1ForwardAnswer>(response);
    return OkStatus();
  });
  if (!made.ok()) {
    reactor->Finish(ToGrpc(made));
    return reactor;
  }
  StartForward(context, reactor, WireRequestOf(*request), std::move(answer), arrived);
  return reactor;
}

void AttentionServiceImpl::StartForward(grpc::CallbackServerContext* context, ForwardReactor* reactor,
                                        const WireForwardRequest& request, std::unique_ptr<ForwardAnswer> answer,
                                        std::chrono::steady_clock::time_point arrived, const Status& refused) {
  if (options_.metrics != nullptr) options_.metrics->RequestStarted();
  // What a refusal is counted under: a loaded layer's name only (a client-chosen name would
  // make a new series per typo), the form once known.
  std::shared_ptr<const Layer> counted_layer;
  std::optional<Form> counted_form = FormFromWire(request.form);
  // Released when this function returns unless the call is started (then at its answer).
  CallGate::Ticket ticket = forward_gate_.Enter();
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
    // The protocol's own conversion refused the request: counted like a decode error.
    if (!refused.ok()) return refused;
    // FORM_UNSPECIFIED: the router's split for this layer (sticky on the request key).
    Form held[std::size(kAllForms)];
    size_t held_count = 0;
    for (const auto& [f, _] : layer->forms) held[held_count++] = f;
    const std::span<const Form> held_forms(held, held_count);
    ATTNSERVE_ASSIGN_OR_RETURN(
        const Form form, request.form == static_cast<int>(WireForm::kUnspecified) && options_.router != nullptr
                             ? StatusOr<Form>(options_.router->Choose(layer->name, held_forms, request.request_key))
                             : ChooseForm(request.form, *layer));
    counted_form = form;
    timeline.routed = std::chrono::steady_clock::now();

    ATTNSERVE_ASSIGN_OR_RETURN(
        DecodedForward decoded,
        DecodeForward(layer->config, request, ForwardLimits{.max_request_scores = options_.max_request_scores}));
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

    CallReporting reporting{.metrics = options_.metrics,
                            .shadow = options_.shadow,
                            .mirror = std::nullopt,
                            .arrived = arrived,
                            .backend = options_.backend};
    // `compare` already runs every other form; a shadow of it would measure nothing new.
    if (options_.shadow != nullptr && options_.router != nullptr && !request.compare) {
      reporting.mirror = options_.router->ShadowMirror(held_forms, form);
    }
    auto call = std::make_shared<ForwardCall>(reactor, std::move(answer), layer, std::move(decoded),
                                              std::move(reporting), std::move(reservation), std::move(ticket),
                                              timeline);
    ForwardCall::Start(std::move(call), form, request.compare, executor_, context);
    return OkStatus();
  });
  // Once Start has run, the jobs' completions answer the call; only earlier errors end here.
  if (!status.ok()) {
    spdlog::debug("Forward layer={}: {}", QuoteUntrusted(request.layer), status.ToString());
    if (options_.metrics != nullptr) {
      options_.metrics->RequestFinished(counted_layer ? std::string_view(counted_layer->name) : std::string_view(),
                                        counted_form, status.code(), SecondsSince(arrived));
    }
    reactor->Finish(ToGrpc(status));
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListLayers(grpc::CallbackServerContext* context,
                                                           const v1::ListLayersRequest* /*request*/,
                                                           v1::ListLayersResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpc(Guarded("ListLayers", [&]() -> Status {
    for (const auto& layer : store_->List()) FillLayerInfo(*layer, response->add_layers());
    return OkStatus();
  })));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetLayer(grpc::CallbackServerContext* context,
                                                         const v1::GetLayerRequest* request, v1::LayerInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpc(Guarded("GetLayer", [&]() -> Status {
    std::shared_ptr<const Layer> layer = store_->Get(request->name());
    if (layer == nullptr) {
      return NotFoundError("name: no layer named " + QuoteUntrusted(request->name()) +
                           " is loaded (loaded: " + LoadedNames(*store_) + ")");
    }
    FillLayerInfo(*layer, response);
    if (request->include_spectrum()) FillSpectrumInfo(*layer, response);
    return OkStatus();
  })));
  return reactor;
}

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
