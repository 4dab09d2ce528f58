// How an operator states the A/B: the server's --route / --shadow-rate / --metrics-listen flags
// and YAML keys (server/server_options), and `attnserve-cli route`'s arguments
// (client/cli/cmd_route). Errors name the flag or key, what was expected and what came.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "client/cli/cmd_route.h"
#include "server/server_options.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

StatusOr<ServerOptions> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "attnserve");
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  return ParseServerOptions(static_cast<int>(argv.size()), argv.data());
}

TEST(RoutingFlagsTest, Defaults) {
  StatusOr<ServerOptions> o = Parse({});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->metrics_listen, "0.0.0.0:9464");
  EXPECT_TRUE(o->metrics_port_file.empty());
  EXPECT_TRUE(o->routes.empty());
  EXPECT_EQ(o->shadow_rate, 0.0);
  EXPECT_EQ(o->shadow_queue, 16);
}

TEST(RoutingFlagsTest, RoutesShadowAndMetricsFlags) {
  StatusOr<ServerOptions> o =
      Parse({"--route", "*=factored:90,summed:10", "--route=demo=summed:1", "--route", "demo=factored:3,summed:1",
             "--shadow-rate", "0.25", "--shadow-queue=8", "--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
             "/tmp/m"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  const std::vector<std::pair<std::string, std::string>> want = {{"*", "factored:90,summed:10"},
                                                                 {"demo", "factored:3,summed:1"}};
  EXPECT_EQ(o->routes, want);  // a later route of the same layer replaces the earlier one
  EXPECT_EQ(o->shadow_rate, 0.25);
  EXPECT_EQ(o->shadow_queue, 8);
  EXPECT_EQ(o->metrics_listen, "127.0.0.1:0");
  EXPECT_EQ(o->metrics_port_file, "/tmp/m");
}

TEST(RoutingFlagsTest, BadValuesAreNamed) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  for (const Case& c : {
           Case{{"--route", "demo"}, "--route: expected LAYER=FORM:WEIGHT,... (LAYER may be '*')"},
           Case{{"--route", "=factored:1"}, "got '=factored:1'"},
           Case{{"--route", "bad name=factored:1"}, "--route: "},
           Case{{"--route", "demo=factored:x"}, "--route demo: expected a finite weight >= 0 for factored, got 'x'"},
           Case{{"--route", "demo=bogus:1"}, "got 'bogus'"},
           Case{{"--route", "demo=factored:0"}, "expected at least one positive weight"},
           Case{{"--shadow-rate", "2"}, "--shadow-rate: expected a fraction in [0, 1], got '2'"},
           Case{{"--shadow-rate", "nan"}, "--shadow-rate: expected a fraction in [0, 1], got 'nan'"},
           Case{{"--shadow-queue", "0"}, "--shadow-queue: expected an integer in [1, 100000], got '0'"},
           Case{{"--metrics-listen", ""}, "--metrics-listen: expected HOST:PORT"},
       }) {
    StatusOr<ServerOptions> o = Parse(c.args);
    ASSERT_FALSE(o.ok()) << c.args[0] << " " << c.args[1];
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(o.status().message(), HasSubstr(c.message)) << c.args[0] << " " << c.args[1];
  }
}

TEST(RoutingFlagsTest, YamlKeys) {
  ServerOptions o;
  Status s = ApplyYamlConfig(
      "metrics_listen: 127.0.0.1:9999\n"
      "metrics_port_file: /tmp/mp\n"
      "routes:\n"
      "  '*': factored:1,summed:1\n"
      "  enc: lowrank:1\n"
      "shadow_rate: 0.05\n"
      "shadow_queue: 4\n",
      "conf.yaml", &o);
  ASSERT_TRUE(s.ok()) << s.ToString();
  const std::vector<std::pair<std::string, std::string>> want = {{"*", "factored:1,summed:1"}, {"enc", "lowrank:1"}};
  EXPECT_EQ(o.routes, want);
  EXPECT_EQ(o.shadow_rate, 0.05);
  EXPECT_EQ(o.shadow_queue, 4);
  EXPECT_EQ(o.metrics_listen, "127.0.0.1:9999");
  EXPECT_EQ(o.metrics_port_file, "/tmp/mp");

  s = ApplyYamlConfig("routes: factored:1\n", "conf.yaml", &o);
  EXPECT_THAT(s.message(), HasSubstr("conf.yaml: routes: expected a mapping LAYER: FORM:WEIGHT,..."));
  s = ApplyYamlConfig("routes:\n  demo: factored:-1\n", "conf.yaml", &o);
  EXPECT_THAT(s.message(), HasSubstr("conf.yaml: routes demo: expected a finite weight >= 0 for factored, got '-1'"));
  s = ApplyYamlConfig("shadow_rate: 1.5\n", "conf.yaml", &o);
  EXPECT_THAT(s.message(), HasSubstr("conf.yaml: shadow_rate: expected a fraction in [0, 1], got '1.5'"));
  s = ApplyYamlConfig("shadow_ratio: 0.5\n", "conf.yaml", &o);
  EXPECT_THAT(s.message(), HasSubstr("unknown key"));
  EXPECT_THAT(s.message(), HasSubstr("shadow_rate"));
}

TEST(RoutingFlagsTest, RoutesFileExcludesRoutes) {
  StatusOr<ServerOptions> o = Parse({"--routes-file", "/etc/attnserve/routes/routes.yaml"});
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->routes_file, "/etc/attnserve/routes/routes.yaml");
  ServerOptions y;
  ASSERT_TRUE(ApplyYamlConfig("routes_file: /r.yaml\n", "conf.yaml", &y).ok());
  EXPECT_EQ(y.routes_file, "/r.yaml");
  // One source of the split: a route beside the file is refused, whichever way it came.
  Status both = Parse({"--routes-file", "/r.yaml", "--route", "*=summed:1"}).status();
  EXPECT_EQ(both.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(both.message(), HasSubstr("routes_file, routes: expected one or the other"));
  EXPECT_THAT(both.message(), HasSubstr("--routes-file '/r.yaml'"));
}

TEST(RoutingFlagsTest, UsageNamesEveryFlag) {
  for (const char* flag : {"--metrics-listen ADDR", "--metrics-port-file FILE", "--route LAYER=SPEC", "--routes-file FILE",
                           "--shadow-rate R", "--shadow-queue N", "(default 0.0.0.0:9464)"}) {
    EXPECT_THAT(UsageText(), HasSubstr(flag));
  }
}

// --- attnserve-cli route ---

TEST(RouteCliTest, ShowSetClearAndShadow) {
  cli::RouteArgs a;
  std::string error;
  ASSERT_TRUE(cli::ParseRouteArgs({}, &a, &error)) << error;
  EXPECT_FALSE(a.change());

  a = {};
  ASSERT_TRUE(cli::ParseRouteArgs({"demo", "summed:1,auto:3"}, &a, &error)) << error;
  ASSERT_EQ(a.weights.size(), 2u);
  EXPECT_EQ(a.weights[1].form(), v1::FORM_AUTO);  // auto is a route target (docs/service.md, "Form auto")
  EXPECT_EQ(a.weights[1].weight(), 3);

  a = {};
  ASSERT_TRUE(cli::ParseRouteArgs({"demo", "factored:90,summed:10"}, &a, &error)) << error;
  EXPECT_TRUE(a.change());
  EXPECT_EQ(a.layer, "demo");
  ASSERT_EQ(a.weights.size(), 2u);
  EXPECT_EQ(a.weights[0].form(), v1::FORM_FACTORED);
  EXPECT_EQ(a.weights[0].weight(), 90);
  EXPECT_EQ(a.weights[1].form(), v1::FORM_SUMMED);
  EXPECT_FALSE(a.shadow_rate.has_value());

  // A target may name its math; it travels as RouteWeight.math and prints back as written.
  a = {};
  ASSERT_TRUE(cli::ParseRouteArgs({"demo", "factored@bf16:90,factored:10"}, &a, &error)) << error;
  ASSERT_EQ(a.weights.size(), 2u);
  EXPECT_EQ(a.weights[0].form(), v1::FORM_FACTORED);
  EXPECT_EQ(a.weights[0].math(), "bf16");
  EXPECT_EQ(a.weights[1].math(), "");
  v1::Route shown;
  for (const v1::RouteWeight& w : a.weights) *shown.add_weights() = w;
  EXPECT_EQ(cli::FormatRoute(shown), "factored@bf16:90,factored:10");
  // The math's name is the server's to judge (math_ab_server_test: SetRouting's error names the
  // maths it knows); the CLI passes it through as written.
  a = {};
  ASSERT_TRUE(cli::ParseRouteArgs({"demo", "factored@fp64:1"}, &a, &error)) << error;
  ASSERT_EQ(a.weights.size(), 1u);
  EXPECT_EQ(a.weights[0].math(), "fp64");
  for (const char* bad : {"factored@:1", "@bf16:1"}) {
    a = {};
    EXPECT_FALSE(cli::ParseRouteArgs({"demo", bad}, &a, &error)) << bad;
    EXPECT_THAT(error, HasSubstr(std::string("optionally @MATH (a math the layer is held in, e.g. bf16)"))) << bad;
    EXPECT_THAT(error, HasSubstr(std::string("(at '") + bad + "')")) << bad;
  }

  a = {};
  ASSERT_TRUE(cli::ParseRouteArgs({"*", "--clear"}, &a, &error)) << error;
  EXPECT_TRUE(a.clear);
  EXPECT_TRUE(a.weights.empty());

  a = {};
  ASSERT_TRUE(cli::ParseRouteArgs({"--shadow-rate", "0.1"}, &a, &error)) << error;
  EXPECT_TRUE(a.change());
  EXPECT_TRUE(a.layer.empty());
  EXPECT_EQ(a.shadow_rate, 0.1);
}

TEST(RouteCliTest, ErrorsNameTheArgument) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  for (const Case& c : {
           Case{{"demo"}, "missing SPEC after LAYER 'demo'"},
           Case{{"demo", "factored"}, "SPEC: expected FORM:WEIGHT[,FORM:WEIGHT...]"},
           Case{{"demo", "fast:1"}, "(at 'fast:1')"},
           Case{{"demo", "routed:1"}, "(at 'routed:1')"},  // the router's choice is no route target
           Case{{"demo", "factored:-1"}, "(at 'factored:-1')"},
           Case{{"demo", "factored:1,"}, "(at '')"},
           Case{{"demo", "factored:1", "extra"}, "unexpected argument 'extra'"},
           Case{{"--clear"}, "--clear: expected a LAYER"},
           Case{{"demo", "factored:1", "--clear"}, "--clear: expected no SPEC, got 'factored:1'"},
           Case{{"--shadow-rate", "1.5"}, "--shadow-rate: expected a fraction in [0, 1], got '1.5'"},
           Case{{"--bogus"}, "--bogus"},
       }) {
    cli::RouteArgs a;
    std::string error;
    EXPECT_FALSE(cli::ParseRouteArgs(c.args, &a, &error)) << c.args[0];
    EXPECT_THAT(error, HasSubstr(c.message)) << c.args[0];
  }
}

TEST(RouteCliTest, FormatsSharesAsPercentages) {
  v1::Route r;
  r.set_layer("demo");
  auto* w = r.add_weights();
  w->set_form(v1::FORM_FACTORED);
  w->set_weight(0.9);
  w = r.add_weights();
  w->set_form(v1::FORM_SUMMED);
  w->set_weight(0.1);
  EXPECT_EQ(cli::FormatRoute(r), "factored:90,summed:10");
  EXPECT_EQ(cli::FormatRoute(v1::Route()), "-");
}

}  // namespace
}  // namespace attnserve
