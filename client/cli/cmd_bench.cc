// attnserve-cli bench --layer L --shape B,N[,M] [--forms F1,F2] [--concurrency C1,C2] ...
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "client/cli/args.h"
#include "client/cli/bench.h"
#include "client/cli/commands.h"

namespace attnserve::cli {
namespace {

// The demo layer's width: what --noop-server describes, so its requests have a real size.
constexpr int64_t kNoopDModel = 768;

std::string FormList(const std::vector<v1::Form>& forms) {
  std::string s;
  for (v1::Form f : forms) s += (s.empty() ? "" : ",") + (f == v1::FORM_UNSPECIFIED ? "routed" : FormName(f));
  return s;
}

std::string Seconds(std::chrono::nanoseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%gs", std::chrono::duration<double>(d).count());
  return buf;
}

}  // namespace

std::string BenchDetails() {
  return BenchFlagsHelp() +
         "\nA closed loop: each concurrency level keeps C requests in flight (gRPC callbacks on\n"
         "one channel, one process), after a warmup. With --interleave slice the forms take\n"
         "turns of at least --slice (and 10x the warmup p50), so each form's requests_per_s is\n"
         "its throughput alone at that concurrency while the machine's drift hits every form\n"
         "alike; with --interleave request consecutive requests alternate forms (latency under\n"
         "one mixed load; a closed loop then completes as many requests of each form, so their\n"
         "throughputs are equal by construction).\n"
         "\nPer form x concurrency: requests (the OK ones), requests_per_s, tokens_per_s (B*N per\n"
         "request), client latency p50/p90/p95/p99/max in ms (exact percentiles of up to\n"
         "--max-samples samples, a uniform reservoir beyond), the server's queue_us, compute_us\n"
         "and batch_requests (means over OK responses), and errors by status code; then one\n"
         "'ratio F/factored:' line per other form with the requests_per_s and p50_ms ratios.\n"
         "A progress line shows while stdout is a terminal.\n"
         "\nOwn cost, measured with --noop-server (an in-process server that answers at once) for\n"
         "1x16x768 float32 requests on 2 cores, 2026-11-29: p50 0.08-0.11 ms per request at\n"
         "concurrency 1, and about 8,900 requests/s at concurrency 32 with the no-op server on\n"
         "the same cores (docs/journal/benchmarks-journal.md, \"attnserve-cli bench\").\n"
         "Latencies near these figures measure the tool.\n"
         "\nExit status 1 when no request succeeded at all.\n";
}

int RunBench(CommandContext& ctx, const std::vector<std::string>& args) {
  BenchArgs ba;
  std::string error;
  if (!ParseBenchArgs(args, &ba, &error)) return ctx.UsageError("bench", error);

  std::unique_ptr<NoopServer> noop;
  std::unique_ptr<Client> own_client;
  ClientOptions options = ctx.options();
  if (ba.noop_server) {
    noop = NoopServer::Start(kNoopDModel, &error);
    if (!noop) return ctx.Fail(grpc::Status(grpc::StatusCode::UNAVAILABLE, error));
    options.target = noop->target();
  } else if (!ba.target.empty()) {
    options.target = ba.target;
  }
  if (options.target != ctx.options().target) own_client = std::make_unique<Client>(options);
  Client& client = own_client ? *own_client : ctx.client();

  v1::LayerInfo info;
  if (grpc::Status s = client.GetLayer(ba.layer, &info); !s.ok()) return ctx.Fail(s);
  // Refuse a form the layer lacks here, once, rather than as thousands of failed requests.
  for (v1::Form f : ba.forms) {
    if (f == v1::FORM_UNSPECIFIED) continue;
    bool held = false;
    std::string forms;
    for (const v1::FormInfo& fi : info.forms()) {
      held = held || fi.form() == f;
      forms += (forms.empty() ? "" : ", ") + FormName(fi.form());
    }
    if (!held) {
      return ctx.Fail(grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          "layer '" + ba.layer + "' does not hold the " + FormName(f) + " form (it holds: " + forms + ")"));
    }
  }
  const int64_t d = info.config().d_model();
  const double bytes = 4.0 * static_cast<double>(ba.batch) * static_cast<double>(ba.n + ba.m) * static_cast<double>(d);
  const double limit = options.max_message_mb > 0 ? options.max_message_mb * 1048576.0
                                                  : static_cast<double>(std::numeric_limits<int32_t>::max());
  if (bytes > limit) {
    return ctx.Fail(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "--shape: a request of " + std::to_string(static_cast<int64_t>(bytes)) +
                                     " bytes exceeds the message limit (--max-message-mb)"));
  }

  std::ostream& out = ctx.out();
  out << "bench: target=" << options.target << (ba.noop_server ? " (no-op server)" : "") << " layer=" << ba.layer
      << " shape=[" << ba.batch << ", " << ba.n << ", " << d << "]";
  if (ba.m > 0) out << " context=[" << ba.batch << ", " << ba.m << ", " << d << "]";
  out << " causal=" << (ba.causal ? "true" : "false") << " forms=" << FormList(ba.forms)
      << " interleave=" << (ba.interleave == Interleave::kSlice ? "slice" : "request")
      << " warmup=" << Seconds(ba.warmup);
  if (ba.requests > 0) {
    out << " requests=" << ba.requests;
  } else {
    out << " duration=" << Seconds(ba.duration);
  }
  out << "\n";
  out.flush();

  // The live line only on a terminal, so files and pipes get clean output.
  const bool live = &out == &std::cout && isatty(STDOUT_FILENO) == 1;
  std::function<void(const BenchProgress&)> progress;
  if (live) {
    progress = [&out](const BenchProgress& p) {
      char line[160];
      std::snprintf(line, sizeof line, "\r\033[K  concurrency %lld %s  %6.1fs  done %lld  %.1f req/s",
                    static_cast<long long>(p.concurrency), p.warmup ? "warmup " : "measure", p.elapsed_s,
                    static_cast<long long>(p.done), p.rate);
      out << line << std::flush;
    };
  }
  const std::vector<BenchCell> cells = RunLoad(client, ba, d, progress);
  if (live) out << "\r\033[K" << std::flush;

  std::vector<BenchRecord> records;
  int64_t ok = 0;
  for (const BenchCell& cell : cells) {
    records.push_back(MakeRecord(ba, cell));
    ok += records.back().requests;
  }
  PrintTable(records, out);
  PrintRatios(records, out);

  std::string title = "attnserve-cli bench: " + ba.layer + ", [" + std::to_string(ba.batch) + ", " +
                      std::to_string(ba.n) + ", " + std::to_string(d) + "]" + (ba.m > 0 ? " cross" : "") +
                      (ba.causal ? " causal" : "");
  const std::pair<const std::string*, std::string> files[] = {
      {&ba.json, RecordsJson(records)}, {&ba.csv, RecordsCsv(records)}, {&ba.plot, RecordsSvg(records, title)}};
  for (const auto& [path, text] : files) {
    if (path->empty()) continue;
    if (grpc::Status s = WriteTextFile(*path, text); !s.ok()) return ctx.Fail(s);
    out << "wrote: " << *path << "\n";
  }
  if (ok == 0) {
    std::string codes;
    for (const BenchRecord& r : records) {
      for (const auto& [code, n] : r.error_codes)
        codes += (codes.empty() ? "" : ", ") + code + " x" + std::to_string(n);
    }
    return ctx.Fail(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "no request succeeded" + (codes.empty() ? std::string() : " (" + codes + ")")));
  }
  return kExitOk;
}

}  // namespace attnserve::cli
