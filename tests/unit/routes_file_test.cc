// server/routing/routes_file and the router's whole-set routes: the generation against an
// FNV-1a written here from its definition, ReplaceRoutes all or nothing, the file's grammar and
// errors, routes checked against the layers held, and the watcher on a real directory: a write
// in place, a rename into place, a Kubernetes ConfigMap `..data` symlink swap, a refused file
// that keeps the last good split, the poll fallback, and a clean stop.
#include "server/routing/routes_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "server/routing/router.h"
#include "tests/unit/temp_dir.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;
using testing::TempDir;

class CountingObserver final : public RoutingObserver {
 public:
  void RouteChanged(std::string_view, const RouteSplit&) override {}
  void RoutesApplied(uint64_t g) override {
    std::lock_guard<std::mutex> lock(mu);
    generation = g;
  }
  void RoutesFileLoaded(bool ok) override {
    std::lock_guard<std::mutex> lock(mu);
    ++(ok ? loaded_ok : loaded_error);
    cv.notify_all();
  }
  void ShadowCompared(std::string_view, Variant, const DivergenceStats&) override {}
  void ShadowDropped(std::string_view) override {}
  // Waits until the file was read `ok` + `error` times in all (with that many of each).
  bool WaitForLoads(int ok, int error, std::chrono::milliseconds timeout = 5s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return loaded_ok >= ok && loaded_error >= error; });
  }
  int ok_count() {
    std::lock_guard<std::mutex> lock(mu);
    return loaded_ok;
  }
  int error_count() {
    std::lock_guard<std::mutex> lock(mu);
    return loaded_error;
  }
  uint64_t last_generation() {
    std::lock_guard<std::mutex> lock(mu);
    return generation;
  }
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;
  int loaded_ok = 0, loaded_error = 0;
};

// FNV-1a 64 from its definition (offset basis, prime), independent of router.cc.
uint64_t Fnv(const std::string& text) {
  uint64_t h = 14695981039346656037ULL;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
  return h;
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::trunc) << text; }

// Waits until `layer`'s split reads `spec`.
bool WaitForRoute(const Router& router, const std::string& layer, const std::string& spec,
                  std::chrono::milliseconds timeout = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (FormatRouteSpec(router.RouteOf(layer)) == spec) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

std::shared_ptr<const Layer> HeldLayer(const std::string& name, std::vector<Form> forms) {
  auto layer = std::make_shared<Layer>();
  layer->name = name;
  for (Form f : forms) layer->forms[f] = nullptr;  // only which forms are held matters here
  return layer;
}

// --- The generation and whole-set routes ---

TEST(RoutesGenerationTest, IsFnv1aOfTheCanonicalTextTo53Bits) {
  const Routes routes = {{"enc", *ParseRouteSpec("summed:3,factored:1")},
                         {"*", *ParseRouteSpec("factored:9,summed:1")}};
  const std::string text = "*=factored:90,summed:10\nenc=factored:25,summed:75\n";
  EXPECT_EQ(CanonicalRoutesText(routes), text);
  EXPECT_EQ(RoutesGeneration(routes), Fnv(text) >> 11);
  EXPECT_LT(RoutesGeneration(routes), uint64_t{1} << 53);
  // The same split written otherwise (order, scale) is the same generation; the default is
  // factored:100 whether written or not; any change of a share is another generation.
  EXPECT_EQ(RoutesGeneration(
                {{"*", *ParseRouteSpec("summed:10,factored:90")}, {"enc", *ParseRouteSpec("factored:0.5,summed:1.5")}}),
            RoutesGeneration(routes));
  EXPECT_EQ(RoutesGeneration({}), RoutesGeneration({{"*", *ParseRouteSpec("factored:1")}}));
  EXPECT_EQ(RoutesGeneration({}), Fnv("*=factored:100\n") >> 11);
  EXPECT_NE(RoutesGeneration(
                {{"*", *ParseRouteSpec("factored:89,summed:11")}, {"enc", *ParseRouteSpec("summed:3,factored:1")}}),
            RoutesGeneration(routes));
}

TEST(RouterReplaceRoutesTest, ReplacesEveryRouteAtOnceOrNothing) {
  CountingObserver obs;
  Router router(&obs);
  EXPECT_EQ(router.generation(), Fnv("*=factored:100\n") >> 11);
  EXPECT_EQ(obs.last_generation(), router.generation());
  ASSERT_TRUE(router.SetRoute("old", *ParseRouteSpec("summed:1")).ok());
  const Routes next = {{"*", *ParseRouteSpec("factored:50,summed:50")}, {"enc", *ParseRouteSpec("summed:1")}};
  ASSERT_TRUE(router.ReplaceRoutes(next).ok());
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("old")), "factored:50,summed:50");  // its own route is gone
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("enc")), "summed:100");
  EXPECT_EQ(router.AllRoutes().size(), 2u);
  EXPECT_EQ(router.generation(), RoutesGeneration(next));
  EXPECT_EQ(obs.last_generation(), router.generation());

  // Refused: nothing changes.
  EXPECT_THAT(
      router.ReplaceRoutes({{"a", *ParseRouteSpec("summed:1")}, {"a", *ParseRouteSpec("factored:1")}}).message(),
      HasSubstr("'a' twice"));
  EXPECT_FALSE(router.ReplaceRoutes({{"", *ParseRouteSpec("summed:1")}}).ok());
  EXPECT_EQ(router.generation(), RoutesGeneration(next));
  // Without "*": the default is factored:100 again.
  ASSERT_TRUE(router.ReplaceRoutes({{"enc", *ParseRouteSpec("summed:1")}}).ok());
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("dec")), "factored:100");
}

// --- The file's grammar and what it may name ---

TEST(RoutesFileParseTest, TheConfigsRoutesKeyAlone) {
  StatusOr<Routes> r = ParseRoutesFile("routes:\n  \"*\": factored:90,summed:10\n  enc: summed:1\n", "f.yaml");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].first, "*");
  EXPECT_EQ(FormatRouteSpec((*r)[0].second), "factored:90,summed:10");
  EXPECT_EQ((*r)[1].first, "enc");
  EXPECT_TRUE(ParseRoutesFile("routes: {}\n", "f.yaml")->empty());
  EXPECT_TRUE(ParseRoutesFile("routes:\n", "f.yaml")->empty());

  auto error = [](const std::string& text) { return ParseRoutesFile(text, "f.yaml").status().message(); };
  EXPECT_THAT(error(""), HasSubstr("f.yaml: expected a mapping 'routes:'"));
  EXPECT_THAT(error("routes:\n  enc: factored:90,sumed:10\n"), HasSubstr("f.yaml: routes: enc: expected a form"));
  EXPECT_THAT(error("routes:\n  enc: factored:-1\n"), HasSubstr("routes: enc: expected a finite weight >= 0"));
  EXPECT_THAT(error("routes:\n  enc: factored:0\n"), HasSubstr("at least one positive weight"));
  EXPECT_THAT(error("routes:\n  enc: [factored:1]\n"),
              HasSubstr("routes: enc: expected FORM:WEIGHT,... as one string"));
  EXPECT_THAT(error("shadow_rate: 1\n"), HasSubstr("got the key 'shadow_rate'"));
  EXPECT_THAT(error("routes: factored:1\n"), HasSubstr("routes: expected a mapping"));
  EXPECT_THAT(error("routes:\n  enc: [\n"), HasSubstr("f.yaml: not valid YAML"));
  // YAML keeps a repeated key: the file says which layer came twice, rather than one route
  // silently replacing the other.
  EXPECT_THAT(error("routes:\n  enc: factored:1\n  dec: summed:1\n  enc: summed:1\n"),
              HasSubstr("f.yaml: routes: enc: expected each layer once, got it twice"));
  EXPECT_THAT(error("routes:\n  \"\": factored:1\n"),
              HasSubstr("f.yaml: routes: expected a layer name or '*', got an empty key"));
}

TEST(RoutesFileParseTest, RoutesMustNameLayersAndFormsHeld) {
  const std::vector<std::shared_ptr<const Layer>> layers = {HeldLayer("enc", {Form::kFactored, Form::kSummed}),
                                                            HeldLayer("dec", {Form::kFactored})};
  EXPECT_TRUE(CheckRoutesHeld({{"enc", *ParseRouteSpec("factored:1,summed:1")}}, layers).ok());
  EXPECT_TRUE(CheckRoutesHeld({{"dec", *ParseRouteSpec("factored:1,summed:0")}}, layers).ok());  // 0: not named
  EXPECT_TRUE(CheckRoutesHeld({{"*", *ParseRouteSpec("factored:1,summed:1")}}, layers).ok());    // enc holds it
  Status s = CheckRoutesHeld({{"dec", *ParseRouteSpec("factored:1,summed:1")}}, layers);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("routes: dec: expected forms the layer holds (factored) or auto, got summed"));
  EXPECT_THAT(CheckRoutesHeld({{"nope", *ParseRouteSpec("factored:1")}}, layers).message(),
              HasSubstr("routes: nope: expected a loaded layer (loaded: enc, dec), got 'nope'"));
  EXPECT_THAT(CheckRoutesHeld({{"*", *ParseRouteSpec("lowrank:1")}}, layers).message(),
              HasSubstr("routes: *: expected forms some loaded layer holds, got lowrank"));
}

// A target's math must be one the layer is held in (--extra-maths); without one, the default.
TEST(RoutesFileParseTest, RoutesMustNameMathsHeld) {
  auto two = std::make_shared<Layer>();
  two->name = "enc";
  two->maths = {Math::kFp32, Math::kBf16};
  for (Form f : {Form::kFactored, Form::kSummed}) {
    two->forms[f] = nullptr;
    two->other_maths[{f, Math::kBf16}] = nullptr;
  }
  const std::vector<std::shared_ptr<const Layer>> layers = {two, HeldLayer("dec", {Form::kFactored})};
  EXPECT_TRUE(CheckRoutesHeld({{"enc", *ParseRouteSpec("factored@bf16:1,factored@fp32:1,summed:1")}}, layers).ok());
  EXPECT_TRUE(CheckRoutesHeld({{"enc", *ParseRouteSpec("auto@bf16:1")}}, layers).ok());
  EXPECT_TRUE(CheckRoutesHeld({{"*", *ParseRouteSpec("summed@bf16:1")}}, layers).ok());  // enc holds it
  Status s = CheckRoutesHeld({{"dec", *ParseRouteSpec("factored@bf16:1")}}, layers);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("routes: dec: expected forms the layer holds (factored) or auto, got factored@bf16"));
  s = CheckRoutesHeld({{"enc", *ParseRouteSpec("auto@fp16:1")}}, layers);
  EXPECT_THAT(s.message(),
              HasSubstr("routes: enc: expected forms the layer holds (factored, summed in fp32, bf16) or auto, got auto@fp16"));
  EXPECT_THAT(CheckRoutesHeld({{"*", *ParseRouteSpec("factored@tf32:1")}}, layers).message(),
              HasSubstr("routes: *: expected forms some loaded layer holds, got factored@tf32"));
}

// --- The watcher on a real directory ---

class RoutesFileWatchTest : public ::testing::Test {
 protected:
  StatusOr<std::unique_ptr<RoutesFile>> Start(bool inotify = true) {
    const std::vector<std::shared_ptr<const Layer>> layers = {HeldLayer("enc", {Form::kFactored, Form::kSummed})};
    return RoutesFile::Start(
        RoutesFileOptions{.path = path, .poll_interval = 100ms, .use_inotify = inotify}, &router,
        [layers](const Routes& routes) { return CheckRoutesHeld(routes, layers); }, &obs);
  }
  TempDir dir;
  std::string path = dir.File("routes.yaml");
  CountingObserver obs;
  Router router{&obs};
};

TEST_F(RoutesFileWatchTest, StartAppliesTheFileOrNamesItsProblem) {
  WriteFile(path, "routes:\n  enc: factored:80,summed:20\n");
  auto file = Start();
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_TRUE((*file)->inotify());
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("enc")), "factored:80,summed:20");
  EXPECT_EQ(obs.ok_count(), 1);

  TempDir other;
  Router fresh;
  WriteFile(other.File("bad.yaml"), "routes:\n  enc: lowrank:1\n");
  auto bad = RoutesFile::Start(
      RoutesFileOptions{.path = other.File("bad.yaml")}, &fresh,
      [](const Routes& r) { return CheckRoutesHeld(r, {HeldLayer("enc", {Form::kFactored})}); }, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--routes-file '" + other.File("bad.yaml") + "': routes: enc:"));
  EXPECT_THAT(bad.status().message(), HasSubstr("got lowrank"));
  EXPECT_EQ(FormatRouteSpec(fresh.RouteOf("enc")), "factored:100");  // nothing applied
  auto missing = RoutesFile::Start(RoutesFileOptions{.path = other.File("none.yaml")}, &fresh, nullptr, nullptr);
  EXPECT_THAT(missing.status().message(), HasSubstr("none.yaml': cannot read it"));
}

TEST_F(RoutesFileWatchTest, ReloadsOnAWriteInPlaceAndOnARenameIntoPlace) {
  WriteFile(path, "routes:\n  enc: factored:1\n");
  auto file = Start();
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  WriteFile(path, "routes:\n  enc: factored:50,summed:50\n");  // IN_CLOSE_WRITE
  EXPECT_TRUE(WaitForRoute(router, "enc", "factored:50,summed:50"));
  WriteFile(dir.File(".routes.yaml.tmp"), "routes:\n  enc: summed:1\n");
  std::filesystem::rename(dir.File(".routes.yaml.tmp"), path);  // IN_MOVED_TO
  EXPECT_TRUE(WaitForRoute(router, "enc", "summed:100"));
  EXPECT_TRUE(obs.WaitForLoads(3, 0));
  EXPECT_EQ(obs.last_generation(), RoutesGeneration({{"enc", *ParseRouteSpec("summed:1")}}));
}

TEST_F(RoutesFileWatchTest, ReloadsOnAConfigMapSymlinkSwap) {
  // What the kubelet does to a mounted ConfigMap: the file is a symlink through `..data`, and
  // an update writes a new timestamped folder, points `..data_tmp` at it and renames that
  // over `..data` (one atomic step), then removes the old folder.
  namespace fs = std::filesystem;
  fs::create_directory(dir.File("..2026_12_05_01"));
  WriteFile(dir.File("..2026_12_05_01/routes.yaml"), "routes:\n  enc: factored:90,summed:10\n");
  fs::create_directory_symlink("..2026_12_05_01", dir.File("..data"));
  fs::create_symlink("..data/routes.yaml", path);
  auto file = Start();
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(FormatRouteSpec(router.RouteOf("enc")), "factored:90,summed:10");

  fs::create_directory(dir.File("..2026_12_05_02"));
  WriteFile(dir.File("..2026_12_05_02/routes.yaml"), "routes:\n  enc: factored:10,summed:90\n");
  fs::create_directory_symlink("..2026_12_05_02", dir.File("..data_tmp"));
  fs::rename(dir.File("..data_tmp"), dir.File("..data"));
  fs::remove_all(dir.File("..2026_12_05_01"));
  EXPECT_TRUE(WaitForRoute(router, "enc", "factored:10,summed:90"));
  EXPECT_TRUE((*file)->inotify());
}

TEST_F(RoutesFileWatchTest, ARefusedFileKeepsTheLastGoodSplitAndIsCounted) {
  WriteFile(path, "routes:\n  enc: factored:70,summed:30\n");
  auto file = Start();
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const uint64_t good = router.generation();
  for (const char* bad : {"routes:\n  enc: factored:70,summed:30,lowrank:5\n",  // a form enc does not hold
                          "routes:\n  enc: factored:70,sumed:30\n",             // not a form
                          "routes:\n  dec: summed:1\n",                         // not a loaded layer
                          "routes: [\n"}) {                                     // not YAML
    const int errors = obs.error_count();
    WriteFile(path, bad);
    ASSERT_TRUE(obs.WaitForLoads(1, errors + 1)) << bad;
    EXPECT_EQ(FormatRouteSpec(router.RouteOf("enc")), "factored:70,summed:30") << bad;
    EXPECT_EQ(FormatRouteSpec(router.RouteOf("dec")), "factored:100") << bad;  // refused whole
    EXPECT_EQ(router.generation(), good) << bad;
  }
  EXPECT_EQ(obs.ok_count(), 1);
  WriteFile(path, "routes:\n  enc: summed:1\n");  // the next good file applies
  EXPECT_TRUE(WaitForRoute(router, "enc", "summed:100"));
  EXPECT_TRUE(obs.WaitForLoads(2, 4));
}

TEST_F(RoutesFileWatchTest, PollsWithoutInotify) {
  WriteFile(path, "routes:\n  enc: factored:1\n");
  auto file = Start(/*inotify=*/false);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_FALSE((*file)->inotify());
  WriteFile(path, "routes:\n  enc: factored:40,summed:60\n");
  EXPECT_TRUE(WaitForRoute(router, "enc", "factored:40,summed:60"));
  // Unchanged content is not reloaded at every poll.
  std::this_thread::sleep_for(350ms);
  EXPECT_EQ(obs.ok_count(), 2);
  EXPECT_EQ(obs.error_count(), 0);
}

TEST_F(RoutesFileWatchTest, AStoppedWatcherChangesNothing) {
  WriteFile(path, "routes:\n  enc: factored:1\n");
  auto file = Start();
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  (*file)->Stop();
  (*file)->Stop();  // idempotent
  WriteFile(path, "routes:\n  enc: summed:1\n");
  EXPECT_FALSE(WaitForRoute(router, "enc", "summed:100", 400ms));
  file->reset();  // the destructor after Stop
}

}  // namespace
}  // namespace attnserve
