// server/routing: route specs and their errors, the split's proportions within statistical
// bounds, sticky keys (FNV-1a against its published test vectors), forms not held, run-time
// changes, the shadow policy, and the shadow runner's bounded queue (drops when full, never
// blocks) and divergence, including a real mirror of the factored form by the summed one.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "server/backend/cpu/cpu_backend.h"
#include "server/batching/batching_executor.h"
#include "server/routing/router.h"
#include "server/routing/shadow.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr Form kBoth[] = {Form::kFactored, Form::kSummed};
constexpr Form kAll[] = {Form::kFactored, Form::kSummed, Form::kLowRank};

class RecordingObserver final : public RoutingObserver {
 public:
  void RouteChanged(std::string_view layer, const RouteSplit& split) override {
    std::lock_guard<std::mutex> lock(mu);
    routes[std::string(layer)] = split;
    ++route_changes;
  }
  void RoutesApplied(uint64_t) override {}  // routes_file_test checks generations
  void RoutesFileLoaded(bool) override {}
  void ShadowCompared(std::string_view layer, Variant mirror, const DivergenceStats& d) override {
    std::lock_guard<std::mutex> lock(mu);
    compared.push_back({std::string(layer), mirror, d});
    cv.notify_all();
  }
  void ShadowDropped(std::string_view layer) override {
    std::lock_guard<std::mutex> lock(mu);
    dropped.push_back(std::string(layer));
    cv.notify_all();
  }
  // Waits until `n` shadows were compared or dropped.
  bool WaitForOutcomes(size_t n, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return compared.size() + dropped.size() >= n; });
  }

  struct Compared {
    std::string layer;
    Variant mirror;
    DivergenceStats divergence;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, RouteSplit> routes;
  int route_changes = 0;
  std::vector<Compared> compared;
  std::vector<std::string> dropped;
};

// --- Route specs ---

TEST(RouteSpecTest, ParsesAndNormalisesWeights) {
  StatusOr<RouteSplit> s = ParseRouteSpec("factored:90,summed:10");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->size(), 2u);
  EXPECT_EQ((*s)[0].first, Form::kFactored);
  EXPECT_DOUBLE_EQ((*s)[0].second, 0.9);
  EXPECT_EQ((*s)[1].first, Form::kSummed);
  EXPECT_DOUBLE_EQ((*s)[1].second, 0.1);

  // Any order, spaces, fractions, zero weights left out of the split.
  s = ParseRouteSpec(" summed : 0.25 , lowrank:0, factored:0.75 ");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->size(), 2u);
  EXPECT_EQ((*s)[0].first, Form::kFactored);
  EXPECT_DOUBLE_EQ((*s)[0].second, 0.75);
  EXPECT_EQ(FormatRouteSpec(*s), "factored:75,summed:25");
}

TEST(RouteSpecTest, ErrorsNameTheFieldExpectedAndGot) {
  struct Case {
    const char* spec;
    const char* message;
  };
  for (const Case& c : {
           Case{"", "route: expected FORM:WEIGHT[,FORM:WEIGHT...]"},
           Case{"factored", "got 'factored' (no ':')"},
           Case{"factored:90,bogus:10", "expected a form among factored, summed, lowrank, auto, got 'bogus'"},
           Case{"auto:1,auto:2", "expected each form at most once, got auto twice"},
           Case{"factored:-1", "expected a finite weight >= 0 for factored, got '-1'"},
           Case{"factored:x", "got 'x'"},
           Case{"factored:", "got ''"},
           Case{"factored:nan", "got 'nan'"},
           Case{"factored:1,factored:2", "expected each form at most once, got factored twice"},
           Case{"factored:0,summed:0", "expected at least one positive weight"},
           Case{"factored:1,", "(no ':')"},
       }) {
    StatusOr<RouteSplit> s = ParseRouteSpec(c.spec);
    ASSERT_FALSE(s.ok()) << c.spec;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr(c.message)) << c.spec;
  }
}

// auto is a target of its own, after the forms; it is no form (the call path resolves it).
TEST(RouteSpecTest, AutoIsATargetAfterTheForms) {
  StatusOr<RouteSplit> s = ParseRouteSpec("auto:3,summed:1");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->size(), 2u);
  EXPECT_EQ((*s)[0].first, Form::kSummed);
  EXPECT_TRUE((*s)[1].first.is_auto());
  EXPECT_EQ((*s)[1].first.form, std::nullopt);
  EXPECT_DOUBLE_EQ((*s)[1].second, 0.75);
  EXPECT_EQ(FormatRouteSpec(*s), "summed:25,auto:75");
  EXPECT_EQ(CanonicalRoutesText({{"*", *s}}), "*=summed:25,auto:75\n");
  EXPECT_NE(RoutesGeneration({{"*", *s}}), RoutesGeneration({{"*", *ParseRouteSpec("summed:1,factored:3")}}));
}

// FORM@MATH names a served variant (server/core/math.h): the same form in two maths is two
// targets, ordered by math within their form, the default math (none named) after them.
TEST(RouteSpecTest, ATargetMayNameItsMath) {
  StatusOr<RouteSplit> s = ParseRouteSpec("factored@bf16:90, factored@fp32:10");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->size(), 2u);
  EXPECT_EQ((*s)[0].first, RouteTarget(Form::kFactored, Math::kFp32));
  EXPECT_DOUBLE_EQ((*s)[0].second, 0.1);
  EXPECT_EQ((*s)[1].first, RouteTarget(Form::kFactored, Math::kBf16));
  EXPECT_EQ(FormatRouteSpec(*s), "factored@fp32:10,factored@bf16:90");
  EXPECT_EQ(CanonicalRoutesText({{"*", *s}}), "*=factored@fp32:10,factored@bf16:90\n");
  // A target with its math and one without are two targets (the default math may be another).
  s = ParseRouteSpec("factored:1,factored@bf16:1,auto@bf16:2");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(FormatRouteSpec(*s), "factored@bf16:25,factored:25,auto@bf16:50");
  EXPECT_NE(RoutesGeneration({{"*", *ParseRouteSpec("factored@bf16:1")}}),
            RoutesGeneration({{"*", *ParseRouteSpec("factored:1")}}));
  for (const auto& [spec, message] : std::vector<std::pair<std::string, std::string>>{
           {"factored@fp64:1", "expected a math after factored@ among fp32, tf32, bf16 or fp16, got 'fp64'"},
           {"factored@:1", "expected a math after factored@ among fp32, tf32, bf16 or fp16, got ''"},
           {"factored@bf16:1,factored@bf16:2", "expected each form at most once, got factored@bf16 twice"},
           {"bogus@bf16:1", "expected a form among factored, summed, lowrank, auto, got 'bogus'"},
           {"factored@bf16:-1", "expected a finite weight >= 0 for factored, got '-1'"},
       }) {
    StatusOr<RouteSplit> bad = ParseRouteSpec(spec);
    ASSERT_FALSE(bad.ok()) << spec;
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(bad.status().message(), HasSubstr(message)) << spec;
  }
}

TEST(RouteSpecTest, FlagSplitsLayerAndSpec) {
  auto f = ParseRouteFlag("*=factored:90,summed:10");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->first, "*");
  EXPECT_EQ(f->second.size(), 2u);
  f = ParseRouteFlag("enc.0=summed:1");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->first, "enc.0");

  f = ParseRouteFlag("factored:90");
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr("--route: expected LAYER=FORM:WEIGHT"));
  EXPECT_THAT(f.status().message(), HasSubstr("got 'factored:90'"));
  f = ParseRouteFlag("=factored:1");
  ASSERT_FALSE(f.ok());
  f = ParseRouteFlag("demo=factored:1,summed:oops");
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr("--route demo: expected a finite weight"));
}

// --- The sticky hash ---

TEST(StickyHashTest, Fnv1aMatchesThePublishedVectors) {
  // From the FNV reference test suite (Fowler, Noll, Vo).
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(Fnv1a64("foobar"), 0x85944171f73967e8ULL);
}

TEST(StickyHashTest, PointsAreUniform) {
  // 20 equal bins over 100000 keys: a chi-square test with 19 degrees of freedom; 43.8 is its
  // 0.999 quantile.
  constexpr int kKeys = 100000, kBins = 20;
  std::vector<int> bins(kBins);
  for (int i = 0; i < kKeys; ++i) {
    const double p = StickyPoint("user-" + std::to_string(i));
    ASSERT_GE(p, 0.0);
    ASSERT_LT(p, 1.0);
    ++bins[static_cast<int>(p * kBins)];
  }
  const double expected = static_cast<double>(kKeys) / kBins;
  double chi2 = 0;
  for (int b : bins) chi2 += (b - expected) * (b - expected) / expected;
  EXPECT_LT(chi2, 43.8);
}

// --- Router ---

// |count - n·p| within 5 standard deviations of a binomial: fails by chance once in ~3.5e6 runs.
void ExpectShare(int count, int n, double p, const std::string& what) {
  const double sd = std::sqrt(n * p * (1 - p));
  EXPECT_NEAR(count, n * p, 5 * sd + 1) << what;
}

TEST(RouterTest, DefaultIsFactoredOnly) {
  Router router;
  for (int i = 0; i < 100; ++i) EXPECT_EQ(router.Choose("any", kBoth, ""), Form::kFactored);
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("any")), "factored:100");
}

TEST(RouterTest, RandomSplitWithinStatisticalBounds) {
  Router router;
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored:90,summed:10")).ok());
  constexpr int kDraws = 100000;
  int summed = 0;
  for (int i = 0; i < kDraws; ++i) summed += router.Choose("demo", kBoth, "") == Form::kSummed;
  ExpectShare(summed, kDraws, 0.1, "90/10 unkeyed");

  ASSERT_TRUE(router.SetRoute("demo", *ParseRouteSpec("factored:1,summed:1,lowrank:2")).ok());
  std::map<Form, int> count;
  for (int i = 0; i < kDraws; ++i) ++count[*router.Choose("demo", kAll, "").form];
  ExpectShare(count[Form::kFactored], kDraws, 0.25, "factored of 1:1:2");
  ExpectShare(count[Form::kSummed], kDraws, 0.25, "summed of 1:1:2");
  ExpectShare(count[Form::kLowRank], kDraws, 0.5, "lowrank of 1:1:2");
}

TEST(RouterTest, KeyedSplitWithinStatisticalBoundsAndSticky) {
  Router router;
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored:70,summed:30")).ok());
  constexpr int kKeys = 50000;
  int summed = 0;
  for (int i = 0; i < kKeys; ++i) summed += router.Choose("demo", kBoth, "session-" + std::to_string(i)) == Form::kSummed;
  ExpectShare(summed, kKeys, 0.3, "70/30 keyed");

  // The same key, asked again and again, from another router, and from another thread, always
  // gets the same form (another process: StickyHashTest.AnotherProcessPicksTheSameForms).
  Router other;
  ASSERT_TRUE(other.SetRoute("*", *ParseRouteSpec("factored:70,summed:30")).ok());
  for (int i = 0; i < 200; ++i) {
    const std::string key = "session-" + std::to_string(i);
    const Form first = *router.Choose("demo", kBoth, key).form;
    for (int j = 0; j < 20; ++j) ASSERT_EQ(router.Choose("demo", kBoth, key), first) << key;
    ASSERT_EQ(other.Choose("demo", kBoth, key), first) << key;
    Form from_thread = Form::kLowRank;
    std::thread([&] { from_thread = *router.Choose("demo", kBoth, key).form; }).join();
    ASSERT_EQ(from_thread, first) << key;
  }
}

// The forms 300 keys get under a 70/30 split, one letter a key.
std::string StickyForms() {
  Router router;
  EXPECT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored:70,summed:30")).ok());
  std::string forms;
  for (int i = 0; i < 300; ++i) {
    forms += router.Choose("demo", kBoth, "session-" + std::to_string(i)) == Form::kSummed ? 's' : 'f';
  }
  return forms;
}

// Another process (this test binary run again, with its own address space and start time) gives
// every key the form this one gives it. Run with ATTNSERVE_STICKY_FORMS_OUT set, the test is that
// other process: it writes its forms there and returns.
TEST(StickyHashTest, AnotherProcessPicksTheSameForms) {
  if (const char* out = std::getenv("ATTNSERVE_STICKY_FORMS_OUT")) {
    std::ofstream(out) << StickyForms();
    return;
  }
  char path[] = "/tmp/attnserve_sticky_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string command = "ATTNSERVE_STICKY_FORMS_OUT='" + std::string(path) + "' '" + exe +
                              "' --gtest_filter=StickyHashTest.AnotherProcessPicksTheSameForms >/dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream in(path);
  std::string theirs;
  std::getline(in, theirs);
  std::remove(path);
  const std::string ours = StickyForms();
  ASSERT_EQ(theirs.size(), ours.size()) << "the other process wrote '" << theirs << "'";
  EXPECT_EQ(theirs, ours);
  const auto summed = std::count(ours.begin(), ours.end(), 's');
  EXPECT_GT(summed, 60) << "a 70/30 split over 300 keys";
  EXPECT_LT(summed, 120) << "a 70/30 split over 300 keys";
}

TEST(RouterTest, WideningASplitOnlyMovesKeysTowardTheGrowingForm) {
  Router router;
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored:90,summed:10")).ok());
  std::vector<Form> before;
  for (int i = 0; i < 5000; ++i) before.push_back(*router.Choose("demo", kBoth, "k" + std::to_string(i)).form);
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored:50,summed:50")).ok());
  int moved = 0;
  for (int i = 0; i < 5000; ++i) {
    const Form now = *router.Choose("demo", kBoth, "k" + std::to_string(i)).form;
    if (before[i] == Form::kSummed) {
      EXPECT_EQ(now, Form::kSummed) << "k" << i;  // canary users stay
    }
    moved += before[i] != now;
  }
  ExpectShare(moved, 5000, 0.4, "keys moved from 90/10 to 50/50");
}

// A route to auto is served by every layer, whatever it holds; its share is kept when another
// target of the split is not held.
TEST(RouterTest, AutoIsChosenByItsShareOnEveryLayer) {
  Router router;
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("auto:100")).ok());
  const Form only_factored[] = {Form::kFactored};
  for (int i = 0; i < 50; ++i) EXPECT_TRUE(router.Choose("demo", only_factored, "").is_auto());
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("lowrank:50,auto:50")).ok());
  for (int i = 0; i < 50; ++i) EXPECT_TRUE(router.Choose("demo", kBoth, "k" + std::to_string(i)).is_auto());
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored:70,auto:30")).ok());
  constexpr int kKeys = 20000;
  int automatic = 0;
  for (int i = 0; i < kKeys; ++i) automatic += router.Choose("demo", kBoth, "session-" + std::to_string(i)).is_auto();
  ExpectShare(automatic, kKeys, 0.3, "70/30 factored/auto keyed");
}

TEST(RouterTest, FormsTheLayerDoesNotHoldAreSkipped) {
  Router router;
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("summed:100")).ok());
  const Form only_factored[] = {Form::kFactored};
  for (int i = 0; i < 100; ++i) EXPECT_EQ(router.Choose("demo", only_factored, ""), Form::kFactored);

  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("lowrank:50,summed:50")).ok());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(router.Choose("demo", kBoth, ""), Form::kSummed);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(router.Choose("demo", kBoth, "key" + std::to_string(i)), Form::kSummed);
}

// A layer held in two maths: the split holds across them in its stated shares, keyed choices
// stick, a target without a math is served in the default one, a math the layer lacks is skipped,
// and auto@MATH keeps its math. The observer hears every target with its math resolved.
TEST(RouterTest, VariantsAreChosenByMathAsWellAsForm) {
  RecordingObserver obs;
  Router router(&obs, Math::kBf16);
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored@fp32:30,factored:70")).ok());
  {
    std::lock_guard<std::mutex> lock(obs.mu);
    const RouteSplit heard = obs.routes["*"];
    ASSERT_EQ(heard.size(), 2u);
    EXPECT_EQ(heard[0].first, RouteTarget(Form::kFactored, Math::kFp32));
    EXPECT_EQ(heard[1].first, RouteTarget(Form::kFactored, Math::kBf16)) << "resolved to the default";
  }
  // Two targets that resolve to one variant are heard as one, their shares added.
  ASSERT_TRUE(router.SetRoute("enc", *ParseRouteSpec("factored@bf16:1,factored:1,summed@fp32:2")).ok());
  {
    std::lock_guard<std::mutex> lock(obs.mu);
    EXPECT_EQ(FormatRouteSpec(obs.routes["enc"]), "factored@bf16:50,summed@fp32:50");
  }
  const Variant held[] = {{Form::kFactored, Math::kFp32}, {Form::kFactored, Math::kBf16},
                          {Form::kSummed, Math::kFp32}, {Form::kSummed, Math::kBf16}};
  constexpr int kKeys = 20000;
  int fp32 = 0;
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = "user-" + std::to_string(i);
    const RouteTarget t = router.Choose("demo", held, Math::kBf16, key);
    ASSERT_EQ(t.form, Form::kFactored);
    ASSERT_TRUE(t.math.has_value());
    fp32 += *t.math == Math::kFp32;
    if (i % 1000 == 0) {
      EXPECT_EQ(router.Choose("demo", held, Math::kBf16, key), t) << "sticky";
    }
  }
  ExpectShare(fp32, kKeys, 0.3, "factored@fp32 of 30/70");

  // A layer held in fp32 alone: the bf16 share is skipped, whatever the key.
  const Variant fp32_only[] = {{Form::kFactored, Math::kFp32}, {Form::kSummed, Math::kFp32}};
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(router.Choose("demo", fp32_only, Math::kFp32, "k" + std::to_string(i)),
              RouteTarget(Form::kFactored, Math::kFp32));
  }
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("auto@bf16:1")).ok());
  EXPECT_EQ(router.Choose("demo", held, Math::kBf16, ""), RouteTarget(std::nullopt, Math::kBf16));
  // auto in a math the layer lacks: nothing applies, the factored form in the default math.
  EXPECT_EQ(router.Choose("demo", fp32_only, Math::kFp32, ""), RouteTarget(Form::kFactored, Math::kFp32));
}

TEST(RouterTest, LayerRoutesOverrideTheDefaultAndCanBeRemoved) {
  RecordingObserver obs;
  Router router(&obs);
  // Told the default at once, its math resolved to the router's default (fp32 here).
  EXPECT_EQ(FormatRouteSpec(obs.routes.at("*")), "factored@fp32:100");
  ASSERT_TRUE(router.SetRoute("*", *ParseRouteSpec("factored:90,summed:10")).ok());
  ASSERT_TRUE(router.SetRoute("enc", *ParseRouteSpec("summed:1")).ok());
  EXPECT_EQ(router.Choose("enc", kBoth, "whoever"), Form::kSummed);
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("dec")), "factored:90,summed:10");
  ASSERT_EQ(router.AllRoutes().size(), 2u);
  EXPECT_EQ(router.AllRoutes()[0].first, "*");
  EXPECT_EQ(FormatRouteSpec(obs.routes.at("enc")), "summed@fp32:100");

  ASSERT_TRUE(router.SetRoute("enc", {}).ok());  // removed: back to the default
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("enc")), "factored:90,summed:10");
  EXPECT_TRUE(obs.routes.at("enc").empty());
  ASSERT_TRUE(router.SetRoute("*", {}).ok());  // the default resets, never disappears
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("enc")), "factored:100");
  EXPECT_EQ(FormatRouteSpec(obs.routes.at("*")), "factored@fp32:100");

  Status empty = router.SetRoute("", *ParseRouteSpec("factored:1"));
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.message(), HasSubstr("layer: expected a layer name or '*'"));
}

TEST(RouterTest, ConcurrentChangesAndChoicesAreSafe) {
  Router router;
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; !stop; ++i) {
      (void)router.SetRoute(i % 2 ? "*" : "demo", *ParseRouteSpec(i % 3 ? "factored:1,summed:1" : "summed:1"));
    }
  });
  std::vector<std::thread> readers;
  std::atomic<int> bad{0}, factored{0}, summed{0};
  // Each reader makes 20000 choices and then goes on until both forms have been chosen (or 10 s
  // pass): a fixed count assumed how the threads interleave, and on a loaded machine the readers
  // could finish before the writer's first write, or while demo was summed-only (12 of 50 runs).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  const auto both_seen = [&] { return summed.load() > 0 && factored.load() > 0; };
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&, t] {
      for (int i = 0; i < 20000 || (!both_seen() && std::chrono::steady_clock::now() < give_up); ++i) {
        const Form f = *router.Choose("demo", kBoth, i % 2 ? "" : "k" + std::to_string(t * i)).form;
        if (f != Form::kFactored && f != Form::kSummed) ++bad;
        ++(f == Form::kSummed ? summed : factored);
      }
    });
  }
  for (auto& r : readers) r.join();
  stop = true;
  writer.join();
  EXPECT_EQ(bad, 0);
  // The routes being written reach the readers: demo's route is summed-only or an even split,
  // so both forms are chosen (a router stuck on its default would choose factored only).
  EXPECT_GT(summed.load(), 0);
  EXPECT_GT(factored.load(), 0);
  // And the last write is what every later choice follows. (Built under TSan by scripts/test,
  // which is what this test is for: SetRoute against Choose.)
  ASSERT_TRUE(router.SetRoute("demo", *ParseRouteSpec("summed:1")).ok());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(router.Choose("demo", kBoth, "key" + std::to_string(i)), Form::kSummed);
}

TEST(ShadowPolicyTest, RateAndMirrorChoice) {
  Router router;
  EXPECT_FALSE(router.ShadowMirror(kBoth, Form::kFactored).has_value());  // rate 0 by default
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    Status s = router.SetShadowRate(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("shadow_rate: expected a fraction in [0, 1]"));
  }
  ASSERT_TRUE(router.SetShadowRate(1).ok());
  const Form only_factored[] = {Form::kFactored};
  EXPECT_FALSE(router.ShadowMirror(only_factored, Form::kFactored).has_value());
  std::map<Form, int> mirrors;
  for (int i = 0; i < 10000; ++i) {
    std::optional<Form> m = router.ShadowMirror(kAll, Form::kSummed);
    ASSERT_TRUE(m.has_value());
    ASSERT_NE(*m, Form::kSummed);
    ++mirrors[*m];
  }
  ExpectShare(mirrors[Form::kFactored], 10000, 0.5, "mirror choice among two others");

  ASSERT_TRUE(router.SetShadowRate(0.2).ok());
  int mirrored = 0;
  for (int i = 0; i < 50000; ++i) mirrored += router.ShadowMirror(kBoth, Form::kFactored).has_value();
  ExpectShare(mirrored, 50000, 0.2, "shadow rate 0.2");
}

// Shadows between precisions: a mirror is any other held variant, the served form in another
// math among them, uniformly.
TEST(ShadowPolicyTest, AMirrorMayBeTheSameFormInAnotherMath) {
  Router router;
  ASSERT_TRUE(router.SetShadowRate(1).ok());
  const Variant one_form[] = {{Form::kFactored, Math::kFp32}, {Form::kFactored, Math::kBf16}};
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(router.ShadowMirror(one_form, {Form::kFactored, Math::kBf16}), (Variant{Form::kFactored, Math::kFp32}));
  }
  const Variant four[] = {{Form::kFactored, Math::kFp32}, {Form::kFactored, Math::kBf16},
                          {Form::kSummed, Math::kFp32}, {Form::kSummed, Math::kBf16}};
  std::map<Variant, int> mirrors;
  for (int i = 0; i < 30000; ++i) {
    const std::optional<Variant> m = router.ShadowMirror(four, {Form::kFactored, Math::kFp32});
    ASSERT_TRUE(m.has_value());
    ++mirrors[*m];
  }
  EXPECT_EQ(mirrors.count({Form::kFactored, Math::kFp32}), 0u) << "never the served variant";
  ExpectShare(mirrors[{Form::kFactored, Math::kBf16}], 30000, 1.0 / 3, "same form, other math");
  ExpectShare(mirrors[{Form::kSummed, Math::kBf16}], 30000, 1.0 / 3, "other form, other math");
}

// --- ShadowRunner ---

// Holds every job until released, then writes output = 1 everywhere.
class GatedExecutor final : public Executor {
 public:
  void Submit(ForwardJob job) override {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    cv_.notify_all();
  }
  bool WaitForJobs(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 10s, [&] { return jobs_.size() >= n; });
  }
  void ReleaseOne(Status status = OkStatus()) {
    ForwardJob job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    for (Sequence& s : job.sequences) {
      for (int64_t r = 0; r < s.n(); ++r)
        for (int64_t c = 0; c < s.output.cols; ++c) s.output.at(r, c) = 1.0f;
    }
    job.done(std::move(status), JobTimings{});
  }
  size_t Waiting() {
    std::lock_guard<std::mutex> lock(mu_);
    return jobs_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ForwardJob> jobs_;
};

std::shared_ptr<const Layer> NamedLayer(const std::string& name) {
  auto layer = std::make_shared<Layer>();
  layer->name = name;
  return layer;
}

// A 1×2×2 request whose served output is {1, 1, 1, 3}: against a mirror of ones, max_abs = 2
// and rel_l2 = 2 / sqrt(12).
ShadowRequest SmallRequest(const std::string& layer) {
  ShadowRequest r;
  r.layer = NamedLayer(layer);
  r.served = {Form::kFactored, Math::kFp32};
  r.mirror = {Form::kSummed, Math::kFp32};
  r.request.input = RequestTensor::Own({0.5f, 0.5f, 0.5f, 0.5f}, 1, 2, 2);
  r.served_output = {1, 1, 1, 3};
  return r;
}

TEST(ShadowRunnerTest, ComparesTheMirrorWithTheServedOutput) {
  GatedExecutor executor;
  RecordingObserver obs;
  ShadowRunner runner(&executor, {.queue_capacity = 4}, &obs);
  ASSERT_TRUE(runner.Offer("demo", 64, [] { return SmallRequest("demo"); }));
  ASSERT_TRUE(executor.WaitForJobs(1));
  executor.ReleaseOne();
  ASSERT_TRUE(obs.WaitForOutcomes(1));
  ASSERT_EQ(obs.compared.size(), 1u);
  EXPECT_EQ(obs.compared[0].layer, "demo");
  EXPECT_EQ(obs.compared[0].mirror, (Variant{Form::kSummed, Math::kFp32}));
  EXPECT_DOUBLE_EQ(obs.compared[0].divergence.max_abs, 2.0);
  EXPECT_NEAR(obs.compared[0].divergence.rel_l2, 2.0 / std::sqrt(12.0), 1e-12);
}

TEST(ShadowRunnerTest, DropsWhenFullWithoutCopyingOrBlocking) {
  GatedExecutor executor;
  RecordingObserver obs;
  ShadowRunner runner(&executor, {.queue_capacity = 2}, &obs);
  int copies = 0;
  auto make = [&] {
    ++copies;
    return SmallRequest("demo");
  };
  ASSERT_TRUE(runner.Offer("demo", 64, make));
  ASSERT_TRUE(executor.WaitForJobs(1));  // the first is running: one at a time in the executor
  ASSERT_TRUE(runner.Offer("demo", 64, make));  // waits in the shadow queue
  EXPECT_EQ(runner.Pending(), 2);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(runner.Offer("demo", 64, make));  // full: dropped at once
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_EQ(copies, 2);
  EXPECT_EQ(obs.dropped.size(), 5u);
  EXPECT_EQ(executor.Waiting(), 1u);  // never more than one mirror in the executor

  executor.ReleaseOne();
  ASSERT_TRUE(executor.WaitForJobs(1));
  executor.ReleaseOne();
  ASSERT_TRUE(obs.WaitForOutcomes(7));
  EXPECT_EQ(obs.compared.size(), 2u);
  // Room again.
  EXPECT_TRUE(runner.Offer("demo", 64, make));
  ASSERT_TRUE(executor.WaitForJobs(1));
  executor.ReleaseOne();
  ASSERT_TRUE(obs.WaitForOutcomes(8));
}

TEST(ShadowRunnerTest, ByteBoundDropsLargeCopies) {
  GatedExecutor executor;
  RecordingObserver obs;
  ShadowRunner runner(&executor, {.queue_capacity = 100, .max_queue_bytes = 1000}, &obs);
  EXPECT_FALSE(runner.Offer("big", 1001, [] { return SmallRequest("big"); }));
  EXPECT_TRUE(runner.Offer("small", 600, [] { return SmallRequest("small"); }));
  EXPECT_FALSE(runner.Offer("small", 600, [] { return SmallRequest("small"); }));  // 1200 > 1000
  ASSERT_EQ(obs.dropped.size(), 2u);
  EXPECT_EQ(obs.dropped[0], "big");
  ASSERT_TRUE(executor.WaitForJobs(1));
  executor.ReleaseOne();
  ASSERT_TRUE(obs.WaitForOutcomes(3));
}

TEST(ShadowRunnerTest, AFailedMirrorIsCountedAsDropped) {
  GatedExecutor executor;
  RecordingObserver obs;
  ShadowRunner runner(&executor, {}, &obs);
  ASSERT_TRUE(runner.Offer("demo", 64, [] { return SmallRequest("demo"); }));
  ASSERT_TRUE(executor.WaitForJobs(1));
  executor.ReleaseOne(ResourceExhaustedError("queue full"));
  ASSERT_TRUE(obs.WaitForOutcomes(1));
  EXPECT_EQ(obs.dropped.size(), 1u);
  EXPECT_TRUE(obs.compared.empty());
}

// A mirror that does not fit the server's memory budget is dropped and counted, never queued,
// and one that fits holds its bytes until it is done.
TEST(ShadowRunnerTest, MirrorsThatDoNotFitTheMemoryBudgetAreDropped) {
  GatedExecutor executor;
  RecordingObserver obs;
  MemoryBudget budget(100, "--max-memory-mb");
  ShadowRunner runner(&executor, ShadowOptions{.queue_capacity = 8, .budget = &budget}, &obs);
  bool built = false;
  EXPECT_FALSE(runner.Offer("demo", 101, [&] {
    built = true;
    return SmallRequest("demo");
  }));
  EXPECT_FALSE(built) << "a dropped mirror costs no copy";
  EXPECT_EQ(obs.dropped.size(), 1u);
  ASSERT_TRUE(runner.Offer("demo", 64, [] { return SmallRequest("demo"); }));
  ASSERT_TRUE(executor.WaitForJobs(1));
  EXPECT_EQ(budget.reserved(), 64);
  EXPECT_FALSE(runner.Offer("demo", 64, [] { return SmallRequest("demo"); })) << "64 + 64 > 100";
  EXPECT_EQ(obs.dropped.size(), 2u);
  executor.ReleaseOne();
  ASSERT_TRUE(obs.WaitForOutcomes(3));
  runner.Shutdown();
  EXPECT_EQ(budget.reserved(), 0);
}

TEST(ShadowRunnerTest, ShutdownDropsWhatWaitsAndRefusesLaterOffers) {
  GatedExecutor executor;
  RecordingObserver obs;
  auto runner = std::make_unique<ShadowRunner>(&executor, ShadowOptions{.queue_capacity = 8}, &obs);
  ASSERT_TRUE(runner->Offer("demo", 64, [] { return SmallRequest("demo"); }));
  ASSERT_TRUE(executor.WaitForJobs(1));
  ASSERT_TRUE(runner->Offer("demo", 64, [] { return SmallRequest("demo"); }));
  ASSERT_TRUE(runner->Offer("demo", 64, [] { return SmallRequest("demo"); }));
  // Shutdown drops the two waiting, then waits for the running mirror: release it from another
  // thread once the drops are reported, so the worker cannot have taken a waiting one first.
  std::thread release([&] {
    EXPECT_TRUE(obs.WaitForOutcomes(2)) << "Shutdown dropped nothing";
    executor.ReleaseOne();
  });
  runner->Shutdown();
  release.join();
  EXPECT_EQ(obs.dropped.size(), 2u);
  EXPECT_EQ(obs.compared.size(), 1u);
  EXPECT_FALSE(runner->Offer("demo", 64, [] { return SmallRequest("demo"); }));
  EXPECT_EQ(obs.dropped.size(), 3u);
  runner.reset();  // a second Shutdown does nothing
}

// A real mirror over a request that sets every field: a rotary layer at position_offset 37 over a
// separate context, causal, with key lengths. Each changes the answer, so a mirror that lost one
// would diverge far beyond float32 rounding (a lost offset did: ~0.6 through the server).
TEST(ShadowRunnerTest, SummedMirrorOfTheFactoredFormAgreesOnTheCpu) {
  CpuBackend backend(CpuBackendOptions{.threads = 1});
  LayerConfig c;
  c.d_model = 32;
  c.heads = 4;
  c.bias = true;
  c.rope_theta = 10000;
  const LayerWeights weights = RandomLayerWeights(*CompleteConfig(c), 11);
  auto layer = std::make_shared<Layer>();
  layer->name = "real";
  layer->config = weights.config;
  layer->device = "cpu";
  layer->forms[Form::kFactored] = *backend.Upload(std::make_shared<const FormWeights>(MaterializeFactored(weights)));
  layer->forms[Form::kSummed] = *backend.Upload(std::make_shared<const FormWeights>(MaterializeSummed(weights)));

  BatchingExecutor executor(&backend, BatchPolicy{.max_queue_delay = std::chrono::microseconds(100)});
  RecordingObserver obs;
  ShadowRunner runner(&executor, {}, &obs);

  // Serve the factored form first, as the service would.
  std::mt19937_64 rng(testing::TestSeed());
  ShadowRequest r;
  r.layer = layer;
  r.served = {Form::kFactored, Math::kFp32};
  r.mirror = {Form::kSummed, Math::kFp32};
  r.request.input = RequestTensor::Own(testing::RandomVector(rng, 2 * 5 * 32), 2, 5, 32);
  r.request.context = RequestTensor::Own(testing::RandomVector(rng, 2 * 7 * 32), 2, 7, 32);
  r.request.causal = true;
  r.request.key_lengths = {7, 4};
  r.request.position_offset = 37;
  r.served_output.resize(2 * 5 * 32);
  {
    std::promise<Status> done;
    ForwardJob job;
    job.layer = layer;
    job.form = Form::kFactored;
    job.sequences = r.request.Sequences(r.served_output.data());
    job.done = [&](Status s, JobTimings) { done.set_value(std::move(s)); };
    executor.Submit(std::move(job));
    ASSERT_TRUE(done.get_future().get().ok());
  }
  // Inputs, context and both outputs.
  EXPECT_EQ(ShadowRequest::BytesFor(r.request), (2 * 5 * 32 + 2 * 7 * 32 + 2 * 2 * 5 * 32) * 4 + 2 * 8);
  ASSERT_TRUE(runner.Offer("real", ShadowRequest::BytesFor(r.request), [&] { return r; }));
  ASSERT_TRUE(obs.WaitForOutcomes(1));
  ASSERT_EQ(obs.compared.size(), 1u) << "dropped instead";
  EXPECT_EQ(obs.compared[0].mirror, (Variant{Form::kSummed, Math::kFp32}));
  EXPECT_GT(obs.compared[0].divergence.rel_l2, 0.0);  // float32 rounding differs between forms
  EXPECT_LT(obs.compared[0].divergence.rel_l2, 1e-5);
  runner.Shutdown();
  executor.Drain(std::chrono::milliseconds(1000));
}

}  // namespace
}  // namespace attnserve
