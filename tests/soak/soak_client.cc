// soak_client: one load process of the soak test (tests/soak/soak_test.py, docs/reliability.md).
//
// Keeps --concurrency Forward calls in flight against a real attnserve for --duration-s seconds
// (saturation: a slot is refilled as soon as its call ends, after 20 ms when the server answered
// RESOURCE_EXHAUSTED), then waits for every call to end and prints one JSON object on stdout:
// what it sent and how each call ended, per request kind and per status code, and the OK answers
// per (layer, served form). Every 10 s it prints the same counters so far on stderr. SIGUSR1
// pauses it (no new calls; --pause-file says when none is in flight) and SIGUSR2 resumes it.
//
// Roles:
//   mix    both forms, routed (FORM_UNSPECIFIED with a sticky request_key), compare, large
//          requests that press --max-memory-mb, a layer that the admin role loads, replaces and
//          unloads, and hostile requests (a [1, 6600, 768] summed request, a wrong d_model, a NaN,
//          a 5000-byte unknown layer name, a layer name that is not UTF-8). Deadlines are
//          generous: every outcome comes from the server, so the server's attnserve_requests_total
//          must equal these counts exactly (but for the request that does not parse, which gRPC
//          answers before the handler: "hostile.invalid_utf8").
//   chaos  the layer "chaos" only: a third of the calls with a 1-5 ms deadline (they expire in
//          the queue, or before they are sent), a third cancelled by the client (TryCancel)
//          0-20 ms after they start, a third plain.
//   admin  one admin call every --admin-period-ms: LoadLayer / replace / UnloadLayer of "churn"
//          and "big", SetRouting of "demo" and "*" (with shadow rates), and refused ones (no
//          token: UNAUTHENTICATED; a checkpoint outside the model dir: NOT_FOUND).
//
// Each kind of call has the status codes it may end with; the orchestrator checks them. OK
// answers of fixed layers are checked for their form and against the first answer to the same
// input (within 1e-3 of its largest magnitude): a response that belongs to another request, or
// is corrupt, counts in "wrong_outputs".
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"

namespace attnserve::soak {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

// SIGUSR1 pauses the load (no new calls; those in flight end and are read), SIGUSR2 resumes
// it: the orchestrator's quiet points, where it reads the server's idle RSS. Once paused with
// nothing in flight, the process writes the number of pauses so far to --pause-file.
std::atomic<bool> g_paused{false};
std::atomic<int> g_pauses{0};
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free);

void OnPauseSignal(int signal) {
  if (signal == SIGUSR1) g_pauses.fetch_add(1);
  g_paused.store(signal == SIGUSR1);
}

// Acknowledges the current pause once (written whole, then renamed).
class PauseAck {
 public:
  explicit PauseAck(std::string file) : file_(std::move(file)) {}
  void Paused() {
    const int pauses = g_pauses.load();
    if (file_.empty() || pauses == acked_) return;
    {
      std::ofstream out(file_ + ".tmp", std::ios::trunc);
      out << pauses << "\n";
    }
    std::rename((file_ + ".tmp").c_str(), file_.c_str());
    acked_ = pauses;
  }

 private:
  const std::string file_;
  int acked_ = 0;
};

void InstallPauseSignals() {
  struct sigaction action {};
  action.sa_handler = OnPauseSignal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGUSR1, &action, nullptr);
  sigaction(SIGUSR2, &action, nullptr);
}

struct Options {
  std::string target;
  std::string role = "mix";
  double duration_s = 60;
  int concurrency = 8;
  uint64_t seed = 1;
  std::string admin_token;
  std::string model_file = "small.gpt2.safetensors";
  int admin_period_ms = 1500;
  double grace_s = 90;     // after the load: how long calls in flight may take to end
  std::string pause_file;  // where a pause is acknowledged (SIGUSR1)
};

// How a call is made: its deadline, and whether the client cancels it.
enum class Mode { kPlain, kTinyDeadline, kCancel };

// One request the process sends again and again (built once; gRPC serialises from it).
struct Variant {
  v1::ForwardRequest request;
  std::string input_key;  // identifies layer + input: answers to it must agree
};

struct Kind {
  std::string name;
  double weight = 1;
  std::vector<Variant> variants;
  std::set<std::string> allowed;  // status codes this kind may end with
  bool check_output = true;       // the layer's weights never change
  int timeout_ms = 60000;
  bool chaos = false;  // per call: plain, tiny deadline or cancelled
};

struct Tally {
  int64_t sent = 0;
  std::map<std::string, int64_t> codes;
  std::map<std::string, std::string> first_message;  // per code
  // Per code, the messages with their numbers blanked ("queue demo/factored/cpu#N is full ..."):
  // which refusal it was (a full queue or the memory budget), at most 8 kinds per code.
  std::map<std::string, std::map<std::string, int64_t>> message_kinds;
};

json TallyJson(const Tally& t) {
  json codes = json::object();
  for (const auto& [c, n] : t.codes) codes[c] = n;
  json messages = json::object();
  for (const auto& [c, m] : t.first_message) messages[c] = m;
  json kinds = json::object();
  for (const auto& [c, m] : t.message_kinds) {
    for (const auto& [text, n] : m) kinds[c][text] = n;
  }
  return json{{"sent", t.sent}, {"codes", codes}, {"first_message", messages}, {"message_kinds", kinds}};
}

// A message with every run of digits replaced by N, cut to 100 bytes, printable ASCII only.
std::string MessageKind(const std::string& message) {
  std::string out;
  for (size_t i = 0; i < message.size() && out.size() < 100; ++i) {
    const unsigned char c = static_cast<unsigned char>(message[i]);
    if (std::isdigit(c)) {
      if (out.empty() || out.back() != 'N') out += 'N';
      while (i + 1 < message.size() && std::isdigit(static_cast<unsigned char>(message[i + 1]))) ++i;
    } else {
      out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
    }
  }
  return out;
}

void Count(Tally* t, const grpc::Status& s) {
  const std::string code = GrpcCodeName(s.error_code());
  ++t->codes[code];
  if (s.ok()) return;
  if (!t->first_message.count(code)) t->first_message[code] = s.error_message().substr(0, 300);
  auto& kinds = t->message_kinds[code];
  const std::string kind = MessageKind(s.error_message());
  if (kinds.count(kind) || kinds.size() < 8) {
    ++kinds[kind];
  } else {
    ++kinds["(other)"];
  }
}

std::vector<float> RandomValues(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

const char* FormName(v1::Form f) {
  switch (f) {
    case v1::FORM_FACTORED:
      return "factored";
    case v1::FORM_SUMMED:
      return "summed";
    case v1::FORM_LOWRANK:
      return "lowrank";
    default:
      return "unspecified";
  }
}

// Requests for `layer` of every shape in `shapes`, `inputs` different inputs each, in `forms`.
std::vector<Variant> MakeVariants(const std::string& kind, const std::string& layer,
                                  const std::vector<std::vector<int64_t>>& shapes, int inputs,
                                  const std::vector<v1::Form>& forms, std::mt19937_64& rng, bool compare = false,
                                  int request_keys = 0) {
  std::vector<Variant> out;
  int key = 0;
  for (const auto& shape : shapes) {
    for (int i = 0; i < inputs; ++i) {
      const size_t n = static_cast<size_t>(shape[0] * shape[1] * shape[2]);
      const v1::Tensor tensor = MakeTensor(RandomValues(n, rng), shape);
      const std::string input_key = kind + ":" + layer + "[" + std::to_string(shape[0]) + "," +
                                    std::to_string(shape[1]) + "," + std::to_string(shape[2]) + "]#" +
                                    std::to_string(i);
      for (v1::Form form : forms) {
        Variant v;
        v.request.set_layer(layer);
        v.request.set_form(form);
        *v.request.mutable_input() = tensor;
        v.request.set_compare(compare);
        if (request_keys > 0) v.request.set_request_key("user-" + std::to_string(key++ % request_keys));
        v.input_key = input_key;
        out.push_back(std::move(v));
      }
    }
  }
  return out;
}

// A kind whose requests go to one layer with one set of options.
Kind MakeKind(const std::string& name, double weight, const std::string& layer,
              const std::vector<std::vector<int64_t>>& shapes, int inputs, const std::vector<v1::Form>& forms,
              std::set<std::string> allowed, std::mt19937_64& rng, bool compare = false, int request_keys = 0) {
  Kind k;
  k.name = name;
  k.weight = weight;
  k.variants = MakeVariants(name, layer, shapes, inputs, forms, rng, compare, request_keys);
  k.allowed = std::move(allowed);
  return k;
}

std::vector<Kind> MixKinds(std::mt19937_64& rng) {
  const std::set<std::string> ok_or_busy = {"OK", "RESOURCE_EXHAUSTED"};
  const std::vector<std::vector<int64_t>> demo_shapes = {{1, 8, 768}, {1, 16, 768}, {2, 16, 768}, {1, 32, 768}};
  const std::vector<std::vector<int64_t>> small_shapes = {{2, 32, 64}, {1, 64, 64}, {3, 8, 64}};
  const v1::Form F = v1::FORM_FACTORED, S = v1::FORM_SUMMED, U = v1::FORM_UNSPECIFIED;
  std::vector<Kind> kinds;
  kinds.push_back(MakeKind("demo.factored", 20, "demo", demo_shapes, 3, {F}, ok_or_busy, rng));
  kinds.push_back(MakeKind("demo.summed", 15, "demo", demo_shapes, 3, {S}, ok_or_busy, rng));
  // Routed by the split the admin role keeps changing, sticky on 16 request keys.
  kinds.push_back(MakeKind("demo.routed", 15, "demo", demo_shapes, 3, {U}, ok_or_busy, rng, false, 16));
  kinds.push_back(MakeKind("demo.compare", 8, "demo", {{1, 16, 768}, {2, 8, 768}}, 2, {F, S}, ok_or_busy, rng, true));
  // Large enough that two or three at once exceed --max-memory-mb: RESOURCE_EXHAUSTED at admission.
  {
    Kind k = MakeKind("demo.large", 3, "demo", {{1, 1024, 768}}, 2, {F, S}, ok_or_busy, rng);
    Kind larger = MakeKind("demo.large", 0, "demo", {{1, 1536, 768}}, 1, {F}, ok_or_busy, rng);
    for (Variant& v : larger.variants) k.variants.push_back(std::move(v));
    kinds.push_back(std::move(k));
  }
  {
    Kind k = MakeKind("gpt2.mixed", 15, "gpt2", small_shapes, 3, {F, S, U}, ok_or_busy, rng);
    // Some causal, some with key lengths, some compared.
    for (size_t i = 0; i < k.variants.size(); ++i) {
      v1::ForwardRequest& r = k.variants[i].request;
      if (i % 4 == 1) r.set_causal(true);
      if (i % 4 == 2) {
        for (int64_t b = 0; b < r.input().shape(0); ++b) r.add_key_lengths(static_cast<int32_t>(1 + b * 3));
      }
      if (i % 4 == 3 && r.form() != U) r.set_compare(true);
      // Options change the answer: each variant is its own input.
      k.variants[i].input_key += "/v" + std::to_string(i);
    }
    kinds.push_back(std::move(k));
  }
  {
    // Loaded, replaced (by a layer without the summed form) and unloaded by the admin role.
    Kind k = MakeKind("churn", 10, "churn", {{1, 16, 64}, {2, 8, 64}}, 2, {F, S, U},
                      {"OK", "RESOURCE_EXHAUSTED", "NOT_FOUND", "FAILED_PRECONDITION"}, rng);
    k.check_output = false;  // its weights change
    kinds.push_back(std::move(k));
  }

  // Hostile requests: each has exactly one right answer.
  // 6600 tokens never fit the memory budget (the scores alone: 6600^2 x 12 heads x 4 bytes).
  kinds.push_back(MakeKind("hostile.oversized", 0.3, "demo", {{1, 6600, 768}}, 1, {S}, {"INVALID_ARGUMENT"}, rng));
  kinds.push_back(MakeKind("hostile.wrong_d_model", 0.5, "demo", {{1, 8, 512}}, 1, {F}, {"INVALID_ARGUMENT"}, rng));
  {
    Kind k = MakeKind("hostile.nan", 0.5, "demo", {{1, 8, 768}}, 1, {S}, {"INVALID_ARGUMENT"}, rng);
    std::string* bytes = k.variants[0].request.mutable_input()->mutable_data();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(bytes->data() + (3 * 768 + 100) * sizeof(float), &nan, sizeof nan);
    kinds.push_back(std::move(k));
  }
  {
    // 5000 bytes of valid UTF-8 with control characters, quotes and a backslash: the server
    // quotes it truncated and escaped.
    Kind k = MakeKind("hostile.unknown_layer", 0.5, "demo", {{1, 8, 768}}, 1, {F}, {"NOT_FOUND"}, rng);
    std::string name = "\x01\x1b[31m'\"\\\n\xc3\xa9";
    name += std::string(5000 - name.size(), 'L');
    k.variants[0].request.set_layer(name);
    kinds.push_back(std::move(k));
  }
  {
    // Invalid UTF-8 in a proto3 string: the request does not parse. gRPC's callback API answers
    // UNIMPLEMENTED with an empty message before any handler runs, so the server never counts it.
    Kind k = MakeKind("hostile.invalid_utf8", 0.2, "demo", {{1, 8, 768}}, 1, {F}, {"UNIMPLEMENTED"}, rng);
    k.variants[0].request.set_layer("demo\xff\xfe");
    kinds.push_back(std::move(k));
  }
  for (Kind& k : kinds) {
    if (k.name.rfind("hostile.", 0) == 0) k.check_output = false;
  }
  return kinds;
}

std::vector<Kind> ChaosKinds(std::mt19937_64& rng) {
  Kind k = MakeKind("chaos", 1, "chaos", {{1, 128, 256}, {2, 64, 256}}, 2,
                    {v1::FORM_FACTORED, v1::FORM_SUMMED, v1::FORM_UNSPECIFIED},
                    {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED"}, rng);
  k.chaos = true;
  k.timeout_ms = 10000;
  return {k};
}

// --- Forward load ---------------------------------------------------------------------------------

class Load {
 public:
  Load(const Options& o, std::vector<Kind> kinds)
      : options_(o), kinds_(std::move(kinds)), pause_ack_(o.pause_file), rng_(o.seed * 7919 + 17) {
    ClientOptions co;
    co.target = o.target;
    co.max_message_mb = 64;
    client_ = std::make_unique<Client>(co);
    stub_ = v1::AttentionService::NewStub(client_->channel());
    for (const Kind& k : kinds_) total_weight_ += k.weight;
    tallies_.resize(kinds_.size());
  }

  // Runs the load, waits for the calls in flight; false when some never ended.
  bool Run() {
    std::thread canceller([this] { CancelLoop(); });
    const auto start = Clock::now();
    const auto end =
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.duration_s));
    auto next_progress = start + std::chrono::seconds(10);
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (int i = 0; i < options_.concurrency; ++i) free_slots_.push(start);
    }
    while (true) {
      const auto now = Clock::now();
      if (now >= end) break;
      if (now >= next_progress) {
        std::cerr << Summary(false).dump() << std::endl;
        next_progress += std::chrono::seconds(10);
      }
      if (g_paused.load()) {  // the calls in flight end and are read; no new ones
        bool idle;
        {
          std::lock_guard<std::mutex> lock(mu_);
          idle = in_flight_ == 0;
        }
        if (idle) pause_ack_.Paused();
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        const auto wake = std::min(end, next_progress);
        if (free_slots_.empty()) {
          cv_.wait_until(lock, wake);
          continue;
        }
        if (free_slots_.top() > now) {
          cv_.wait_until(lock, std::min(wake, free_slots_.top()));
          continue;
        }
        free_slots_.pop();
        ++in_flight_;
      }
      Launch();
    }
    bool all_ended;
    {
      std::unique_lock<std::mutex> lock(mu_);
      all_ended =
          cv_.wait_for(lock, std::chrono::duration<double>(options_.grace_s), [this] { return in_flight_ == 0; });
    }
    {
      std::lock_guard<std::mutex> lock(cancel_mu_);
      stop_cancelling_ = true;
    }
    cancel_cv_.notify_all();
    canceller.join();
    return all_ended;
  }

  json Summary(bool final) {
    std::lock_guard<std::mutex> lock(mu_);
    Tally total;
    json kinds = json::object();
    for (size_t i = 0; i < kinds_.size(); ++i) {
      const Tally& t = tallies_[i];
      total.sent += t.sent;
      for (const auto& [c, n] : t.codes) total.codes[c] += n;
      json k = TallyJson(t);
      k["allowed"] = kinds_[i].allowed;
      kinds[kinds_[i].name] = std::move(k);
    }
    int64_t ended = 0;
    for (const auto& [c, n] : total.codes) ended += n;
    json ok_by = json::object();
    for (const auto& [k, n] : ok_by_layer_form_) ok_by[k] = n;
    json chaos_modes = json::object();
    for (const auto& [m, t] : mode_tallies_) chaos_modes[m] = TallyJson(t);
    json out{{"final", final},
             {"role", options_.role},
             {"sent", total.sent},
             {"ended", ended},
             {"in_flight", in_flight_},
             {"codes", TallyJson(total)["codes"]},
             {"ok_by_layer_form", ok_by},
             {"wrong_outputs", wrong_outputs_},
             {"wrong_output_notes", wrong_notes_},
             {"checked_outputs", checked_outputs_},
             {"kinds", kinds}};
    if (!mode_tallies_.empty()) out["chaos_modes"] = chaos_modes;
    return out;
  }

 private:
  struct Call {
    grpc::ClientContext ctx;
    const Variant* variant = nullptr;
    size_t kind = 0;
    Mode mode = Mode::kPlain;
    v1::ForwardResponse response;
  };

  void Launch() {
    size_t kind_index = 0;
    const Variant* variant = nullptr;
    Mode mode = Mode::kPlain;
    int timeout_ms = 0;
    Clock::duration cancel_after{};
    {
      std::lock_guard<std::mutex> lock(mu_);
      double r = std::uniform_real_distribution<double>(0, total_weight_)(rng_);
      kind_index = kinds_.size() - 1;
      for (size_t i = 0; i < kinds_.size(); ++i) {
        if (r < kinds_[i].weight) {
          kind_index = i;
          break;
        }
        r -= kinds_[i].weight;
      }
      const Kind& kind = kinds_[kind_index];
      variant = &kind.variants[std::uniform_int_distribution<size_t>(0, kind.variants.size() - 1)(rng_)];
      timeout_ms = kind.timeout_ms;
      if (kind.chaos) {
        const int pick = std::uniform_int_distribution<int>(0, 2)(rng_);
        if (pick == 0) {
          mode = Mode::kTinyDeadline;
          timeout_ms = std::uniform_int_distribution<int>(1, 5)(rng_);
        } else if (pick == 1) {
          mode = Mode::kCancel;
          cancel_after = std::chrono::microseconds(std::uniform_int_distribution<int>(0, 20000)(rng_));
        }
      }
      ++tallies_[kind_index].sent;
      if (kind.chaos) ++mode_tallies_[ModeName(mode)].sent;
    }
    auto call = std::make_shared<Call>();
    call->variant = variant;
    call->kind = kind_index;
    call->mode = mode;
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    if (mode == Mode::kCancel) {
      {
        std::lock_guard<std::mutex> lock(cancel_mu_);
        cancels_.push({Clock::now() + cancel_after, call});
      }
      cancel_cv_.notify_one();
    }
    stub_->async()->Forward(&call->ctx, &variant->request, &call->response, [this, call](grpc::Status status) mutable {
      Outcome outcome = Inspect(*call, status);
      // The call and its context go before the slot is freed: once the
      // last slot is free the load may end, and the channel with it.
      call.reset();
      Record(outcome, status);
    });
  }

  // What a finished call leaves for the tallies.
  struct Outcome {
    size_t kind = 0;
    Mode mode = Mode::kPlain;
    std::string layer_form;  // for OK answers
    std::string wrong;       // why the answer is wrong, "" when it is right
  };

  static const char* ModeName(Mode m) {
    switch (m) {
      case Mode::kTinyDeadline:
        return "tiny_deadline";
      case Mode::kCancel:
        return "cancelled";
      default:
        return "plain";
    }
  }

  // On a gRPC thread: check the answer.
  Outcome Inspect(const Call& call, const grpc::Status& status) {
    Outcome o;
    o.kind = call.kind;
    o.mode = call.mode;
    if (status.ok()) {
      o.layer_form = call.variant->request.layer() + "/" + FormName(call.response.form());
      o.wrong = CheckAnswer(kinds_[call.kind], *call.variant, call.response);
    }
    return o;
  }

  // On a gRPC thread: count and free the slot. Nothing touches the load after the unlock.
  void Record(const Outcome& o, const grpc::Status& status) {
    const Kind& kind = kinds_[o.kind];
    const bool busy = status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    std::lock_guard<std::mutex> lock(mu_);
    Count(&tallies_[o.kind], status);
    if (kind.chaos) Count(&mode_tallies_[ModeName(o.mode)], status);
    if (status.ok()) {
      ++ok_by_layer_form_[o.layer_form];
      if (kind.check_output) ++checked_outputs_;
    }
    if (!o.wrong.empty()) {
      ++wrong_outputs_;
      if (wrong_notes_.size() < 10) wrong_notes_.push_back(kind.name + ": " + o.wrong);
    }
    // A refused slot waits 20 ms, as a client backing off would: saturation, not a spin.
    free_slots_.push(Clock::now() + (busy ? std::chrono::milliseconds(20) : std::chrono::milliseconds(0)));
    --in_flight_;
    cv_.notify_all();  // under the lock: the load cannot end (and the cv go) before it returns
  }

  // "" when the answer is right: the asked-for form, the input's shape, finite values, and
  // within 1e-3 (of the largest magnitude) of the first answer to the same input.
  std::string CheckAnswer(const Kind& kind, const Variant& v, const v1::ForwardResponse& r) {
    const v1::ForwardRequest& q = v.request;
    if (q.form() != v1::FORM_UNSPECIFIED && r.form() != q.form()) {
      return std::string("asked for ") + FormName(q.form()) + ", served by " + FormName(r.form());
    }
    if (r.output().shape_size() != 3 || r.output().shape(0) != q.input().shape(0) ||
        r.output().shape(1) != q.input().shape(1) || r.output().shape(2) != q.input().shape(2)) {
      return "output shape differs from the input's";
    }
    if (q.compare() && r.divergence_size() < 1) return "compare=true without a divergence";
    std::vector<float> values;
    if (grpc::Status s = TensorToFloats(r.output(), &values); !s.ok()) return "output: " + s.error_message();
    for (float x : values) {
      if (!std::isfinite(x)) return "non-finite value in an OK answer";
    }
    if (!kind.check_output) return "";
    std::lock_guard<std::mutex> lock(reference_mu_);
    auto [it, inserted] = references_.try_emplace(v.input_key);
    if (inserted) {
      it->second = std::move(values);
      return "";
    }
    const std::vector<float>& ref = it->second;
    if (ref.size() != values.size()) return "answer size differs from an earlier answer to the same input";
    float scale = 1e-6f, diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      scale = std::max(scale, std::abs(ref[i]));
      diff = std::max(diff, std::abs(ref[i] - values[i]));
    }
    if (diff > 1e-3f * scale) {
      return "answer differs from an earlier answer to the same input (" + v.input_key + "): max |diff| " +
             std::to_string(diff) + " of " + std::to_string(scale);
    }
    return "";
  }

  void CancelLoop() {
    std::unique_lock<std::mutex> lock(cancel_mu_);
    while (true) {
      if (stop_cancelling_) return;
      if (cancels_.empty()) {
        cancel_cv_.wait(lock);
        continue;
      }
      const auto when = cancels_.top().when;
      if (Clock::now() < when) {
        cancel_cv_.wait_until(lock, when);
        continue;
      }
      std::weak_ptr<Call> weak = cancels_.top().call;
      cancels_.pop();
      if (auto call = weak.lock()) call->ctx.TryCancel();  // no effect once the call has ended
    }
  }

  struct PendingCancel {
    Clock::time_point when;
    std::weak_ptr<Call> call;
    bool operator>(const PendingCancel& o) const { return when > o.when; }
  };

  const Options options_;
  std::vector<Kind> kinds_;
  double total_weight_ = 0;
  std::unique_ptr<Client> client_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  PauseAck pause_ack_;  // main thread only

  std::mutex mu_;
  std::condition_variable cv_;
  std::mt19937_64 rng_;                                                                                // guarded by mu_
  std::priority_queue<Clock::time_point, std::vector<Clock::time_point>, std::greater<>> free_slots_;  // mu_
  int64_t in_flight_ = 0;                                                                              // guarded by mu_
  std::vector<Tally> tallies_;                                                                         // guarded by mu_
  std::map<std::string, Tally> mode_tallies_;                                                          // guarded by mu_
  std::map<std::string, int64_t> ok_by_layer_form_;                                                    // guarded by mu_
  int64_t wrong_outputs_ = 0, checked_outputs_ = 0;                                                    // guarded by mu_
  std::vector<std::string> wrong_notes_;                                                               // guarded by mu_

  std::mutex reference_mu_;
  std::map<std::string, std::vector<float>> references_;  // guarded by reference_mu_

  std::mutex cancel_mu_;
  std::condition_variable cancel_cv_;
  std::priority_queue<PendingCancel, std::vector<PendingCancel>, std::greater<>> cancels_;  // cancel_mu_
  bool stop_cancelling_ = false;                                                            // cancel_mu_
};

// --- Admin churn ----------------------------------------------------------------------------------

struct AdminStep {
  std::string name;
  std::string expected;  // the status code this step must end with
  std::function<grpc::Status(int cycle)> run;
};

v1::SetRoutingRequest Route(const std::string& layer, std::vector<std::pair<v1::Form, double>> weights,
                            std::optional<double> shadow_rate = std::nullopt) {
  v1::SetRoutingRequest r;
  r.set_layer(layer);
  for (const auto& [form, weight] : weights) {
    v1::RouteWeight* w = r.add_weights();
    w->set_form(form);
    w->set_weight(weight);
  }
  if (shadow_rate) r.set_shadow_rate(*shadow_rate);
  return r;
}

int RunAdmin(const Options& o) {
  ClientOptions co;
  co.target = o.target;
  co.admin_token = o.admin_token;
  Client admin(co);
  ClientOptions anonymous_options = co;
  anonymous_options.admin_token.clear();
  Client anonymous(anonymous_options);
  const std::string model = "safetensors:" + o.model_file + ",heads=4";
  std::vector<AdminStep> steps = {
      {"load churn (checkpoint)", "OK", [&](int) { return admin.LoadLayer("churn", model, nullptr); }},
      {"route demo factored:1,summed:1", "OK",
       [&](int) {
         v1::RoutingInfo info;
         return admin.SetRouting(Route("demo", {{v1::FORM_FACTORED, 1}, {v1::FORM_SUMMED, 1}}), &info);
       }},
      {"replace churn (random, summed=false)", "OK",
       [&](int c) {
         return admin.LoadLayer("churn", "random:d_model=64,heads=4,summed=false,seed=" + std::to_string(100 + c),
                                nullptr);
       }},
      {"load big (random d_model=1024, 80 MB)", "OK",
       [&](int c) {
         return admin.LoadLayer("big", "random:d_model=1024,heads=16,seed=" + std::to_string(200 + c), nullptr);
       }},
      {"route * factored:30,summed:70 shadow 0.5", "OK",
       [&](int) {
         v1::RoutingInfo info;
         return admin.SetRouting(Route("*", {{v1::FORM_FACTORED, 30}, {v1::FORM_SUMMED, 70}}, 0.5), &info);
       }},
      {"unload churn", "OK", [&](int) { return admin.UnloadLayer("churn"); }},
      {"load without the token", "UNAUTHENTICATED", [&](int) { return anonymous.LoadLayer("churn", model, nullptr); }},
      {"unload big", "OK", [&](int) { return admin.UnloadLayer("big"); }},
      {"route demo --clear, shadow 0.2", "OK",
       [&](int) {
         v1::RoutingInfo info;
         return admin.SetRouting(Route("demo", {}, 0.2), &info);
       }},
      {"load a checkpoint outside the model dir", "NOT_FOUND",
       [&](int) { return admin.LoadLayer("evil", "safetensors:/etc/passwd,heads=4", nullptr); }},
      {"route * factored:100", "OK",
       [&](int) {
         v1::RoutingInfo info;
         return admin.SetRouting(Route("*", {{v1::FORM_FACTORED, 100}}), &info);
       }},
  };
  std::map<std::string, Tally> tallies;
  int64_t unexpected = 0;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_s));
  auto next = start;
  int64_t calls = 0;
  PauseAck pause_ack(o.pause_file);
  // Sleeps until `t`, and while paused (acknowledged at once: no admin call is in flight here).
  auto wait_until = [&](Clock::time_point t) {
    for (;;) {
      const auto now = Clock::now();
      if (g_paused.load() && now < end) {
        pause_ack.Paused();
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      if (now >= t) return;
      std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(5), t - now));
    }
  };
  for (int cycle = 0; Clock::now() < end; ++cycle) {
    for (const AdminStep& step : steps) {
      wait_until(next);
      next += std::chrono::milliseconds(o.admin_period_ms);
      if (Clock::now() >= end) break;
      Tally& t = tallies[step.name];
      ++t.sent;
      const grpc::Status s = step.run(cycle);
      Count(&t, s);
      if (GrpcCodeName(s.error_code()) != step.expected) ++unexpected;
      if (++calls % 10 == 0) std::cerr << "admin: " << calls << " calls, " << unexpected << " unexpected" << std::endl;
    }
  }
  json steps_json = json::object();
  Tally total;
  for (const AdminStep& step : steps) {
    json t = TallyJson(tallies[step.name]);
    t["expected"] = step.expected;
    steps_json[step.name] = t;
    total.sent += tallies[step.name].sent;
    for (const auto& [c, n] : tallies[step.name].codes) total.codes[c] += n;
  }
  int64_t ended = 0;
  for (const auto& [c, n] : total.codes) ended += n;
  json out{{"final", true},
           {"role", "admin"},
           {"sent", total.sent},
           {"ended", ended},
           {"in_flight", 0},
           {"codes", TallyJson(total)["codes"]},
           {"unexpected", unexpected},
           {"steps", steps_json}};
  std::cout << out.dump() << std::endl;
  return 0;
}

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "soak_client: " << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--target")
      o->target = value();
    else if (a == "--role")
      o->role = value();
    else if (a == "--duration-s")
      o->duration_s = std::stod(value());
    else if (a == "--concurrency")
      o->concurrency = std::stoi(value());
    else if (a == "--seed")
      o->seed = std::stoull(value());
    else if (a == "--admin-token")
      o->admin_token = value();
    else if (a == "--model-file")
      o->model_file = value();
    else if (a == "--admin-period-ms")
      o->admin_period_ms = std::stoi(value());
    else if (a == "--grace-s")
      o->grace_s = std::stod(value());
    else if (a == "--pause-file")
      o->pause_file = value();
    else {
      std::cerr << "soak_client: unknown argument " << a << "\n";
      return false;
    }
  }
  return !o->target.empty() && (o->role == "mix" || o->role == "chaos" || o->role == "admin");
}

}  // namespace
}  // namespace attnserve::soak

int main(int argc, char** argv) {
  using namespace attnserve::soak;
  Options o;
  if (!ParseArgs(argc, argv, &o)) {
    std::cerr
        << "usage: soak_client --target HOST:PORT --role mix|chaos|admin [--duration-s S] [--concurrency N]\n"
           "                   [--seed N] [--admin-token T] [--model-file F] [--admin-period-ms MS] [--grace-s S]\n"
           "                   [--pause-file F]\n";
    return 2;
  }
  InstallPauseSignals();
  if (o.role == "admin") return RunAdmin(o);
  std::mt19937_64 rng(o.seed);
  Load load(o, o.role == "mix" ? MixKinds(rng) : ChaosKinds(rng));
  const bool all_ended = load.Run();
  std::cout << load.Summary(true).dump() << std::endl;
  std::cout.flush();
  // Calls that never ended still reference the load: leave without destroying it.
  if (!all_ended) std::_Exit(3);
  return 0;
}
