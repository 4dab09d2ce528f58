// Spectra on the wire and in the CLI: the store's per-layer spectrum and low-rank ranks into
// LayerInfo (server/service/spectrum_proto.h), the CLI's table and SVG views of them
// (client/cli/spectrum_view.h), and `attnserve-cli layer NAME --spectrum --plot FILE` against an
// in-process AttentionService that answers GetLayer from a real LayerStore.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "client/cli/args.h"
#include "client/cli/commands.h"
#include "client/cli/spectrum_view.h"
#include "client/npy.h"
#include "server/core/form_table.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/core/forms.h"
#include "server/service/service.h"
#include "server/service/spectrum_proto.h"
#include "server/store/layer_store.h"
#include "server/store/source.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

Backend& Cpu() {
  static CpuBackend backend;
  return backend;
}

// The service's own LayerInfo, with the spectra GetLayer adds when include_spectrum is set.
v1::LayerInfo Describe(const Layer& layer, bool include_spectrum) {
  v1::LayerInfo info;
  FillLayerInfo(layer, &info);
  if (include_spectrum) FillSpectrumInfo(layer, &info);
  return info;
}

std::shared_ptr<const Layer> MustLoad(LayerStore& store, const std::string& name, const std::string& source) {
  auto layer = store.Load(name, source);
  EXPECT_TRUE(layer.ok()) << layer.status().ToString();
  return layer.ok() ? *layer : nullptr;
}

// ---- spectrum_proto ----------------------------------------------------------------------------

TEST(SpectrumProto, CarriesTheStoresSpectrumAndRanks) {
  LayerStore store(&Cpu());
  const auto layer = MustLoad(store, "l", "random:d_model=40,heads=4,kv_heads=2,d_head=6,rope_theta=10000,"
                                          "lowrank=budget:10");
  ASSERT_NE(layer, nullptr);
  const v1::LayerInfo without = Describe(*layer, false);
  EXPECT_EQ(without.ov_spectrum_size(), 0);
  EXPECT_EQ(without.qk_spectrum_size(), 0);
  EXPECT_EQ(without.config().rope_theta(), 10000.0);

  const v1::LayerInfo info = Describe(*layer, true);
  ASSERT_EQ(info.ov_spectrum_size(), 4);
  ASSERT_EQ(info.qk_spectrum_size(), 4);
  for (int i = 0; i < 4; ++i) {
    const HeadSpectrum& ov = layer->spectrum->ov[i];
    const v1::HeadSpectrum& p = info.ov_spectrum(i);
    EXPECT_EQ(std::vector<double>(p.singular_values().begin(), p.singular_values().end()), ov.singular_values);
    EXPECT_EQ(p.frobenius(), ov.frobenius);
    EXPECT_EQ(p.stable_rank(), ov.stable_rank);
    EXPECT_EQ(p.effective_rank(), ov.effective_rank);
    EXPECT_EQ(p.rank_90(), ov.rank_90);
    EXPECT_EQ(p.rank_99(), ov.rank_99);
    EXPECT_EQ(p.rank_999(), ov.rank_999);
    EXPECT_EQ(info.qk_spectrum(i).singular_values_size(), 6);
    EXPECT_EQ(info.qk_spectrum(i).rank_999(), layer->spectrum->qk[i].rank_999);
  }
  int lowrank_forms = 0;
  for (const v1::FormInfo& f : info.forms()) {
    if (f.form() != v1::FORM_LOWRANK) {
      EXPECT_EQ(f.ranks_size(), 0);
      continue;
    }
    ++lowrank_forms;
    EXPECT_EQ(std::vector<int64_t>(f.ranks().begin(), f.ranks().end()), layer->lowrank_ranks);
    EXPECT_EQ(f.rank_selection(), "budget:10");
    EXPECT_EQ(f.kept_energy(), layer->lowrank_kept_energy);
    EXPECT_EQ(f.parameters(), FormParameters(Form::kLowRank, layer->config, 10));
  }
  EXPECT_EQ(lowrank_forms, 1);

  // A layer loaded without spectra sends none, even when asked.
  const auto none = MustLoad(store, "n", "random:d_model=16,heads=2,spectrum=false");
  ASSERT_NE(none, nullptr);
  EXPECT_EQ(Describe(*none, true).ov_spectrum_size(), 0);
}

// ---- The views ----------------------------------------------------------------------------------

// Every tag opened is closed, in order (a small well-formedness check; no XML parser needed).
bool TagsBalance(const std::string& xml, std::string* why) {
  std::vector<std::string> open;
  for (size_t i = xml.find('<'); i != std::string::npos; i = xml.find('<', i + 1)) {
    const size_t end = xml.find('>', i);
    if (end == std::string::npos) {
      *why = "unterminated tag at " + std::to_string(i);
      return false;
    }
    const std::string tag = xml.substr(i + 1, end - i - 1);
    if (tag.empty() || tag[0] == '?' || tag[0] == '!') continue;
    if (tag.back() == '/') continue;
    const std::string name = tag.substr(tag[0] == '/' ? 1 : 0, tag.find_first_of(" \n") - (tag[0] == '/' ? 1 : 0));
    if (tag[0] != '/') {
      open.push_back(name);
    } else if (open.empty() || open.back() != name) {
      *why = "</" + name + "> closes " + (open.empty() ? "nothing" : "<" + open.back() + ">");
      return false;
    } else {
      open.pop_back();
    }
  }
  if (!open.empty()) *why = "<" + open.back() + "> is never closed";
  return open.empty();
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t i = text.find(what); i != std::string::npos; i = text.find(what, i + 1)) ++n;
  return n;
}

TEST(SpectrumView, TableHasOneRowPerHeadAndSide) {
  LayerStore store(&Cpu());
  const auto layer = MustLoad(store, "t", "random:d_model=32,heads=3,d_head=8,seed=9");
  ASSERT_NE(layer, nullptr);
  const std::string table = cli::SpectrumTable(Describe(*layer, true));
  EXPECT_THAT(table, HasSubstr("OV spectrum: W_V·W_O per query head (8 singular values per head"));
  EXPECT_THAT(table, HasSubstr("QK spectrum: W_Q·W_Kᵀ per query head"));
  EXPECT_EQ(Count(table, "HEAD  SIGMA1"), 2u);
  EXPECT_THAT(table, HasSubstr("STABLE_RANK  EFFECTIVE_RANK  R90  R99  R99.9\n"));
  std::istringstream lines(table);
  std::string line;
  int rows = 0;
  while (std::getline(lines, line)) {
    if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0]))) {
      ++rows;
      // HEAD SIGMA1 FROBENIUS STABLE EFFECTIVE R90 R99 R99.9
      std::istringstream cells(line);
      std::vector<std::string> c;
      for (std::string s; cells >> s;) c.push_back(s);
      ASSERT_EQ(c.size(), 8u) << line;
      EXPECT_LE(std::stoi(c[5]), std::stoi(c[6])) << line;
      EXPECT_LE(std::stoi(c[6]), std::stoi(c[7])) << line;
      EXPECT_LE(std::stoi(c[7]), 8) << line;
    }
  }
  EXPECT_EQ(rows, 6);
}

TEST(SpectrumView, SvgIsAPlainDocumentWithACurvePerHead) {
  LayerStore store(&Cpu());
  const auto ok = MustLoad(store, "plot", "random:d_model=48,heads=5,kv_heads=1,d_head=16,seed=3");
  ASSERT_NE(ok, nullptr);
  v1::LayerInfo info = Describe(*ok, true);
  info.set_name("a&b<c\"d");  // not a valid layer name, but the view escapes whatever it prints
  const std::string svg = cli::SpectrumSvg(info);
  EXPECT_EQ(svg.rfind("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  std::string why;
  EXPECT_TRUE(TagsBalance(svg, &why)) << why;
  EXPECT_THAT(svg, HasSubstr("a&amp;b&lt;c&quot;d"));
  EXPECT_THAT(svg, Not(HasSubstr("a&b")));
  EXPECT_EQ(Count(svg, "<polyline"), 10u);  // 5 heads × (OV, QK)
  EXPECT_THAT(svg, HasSubstr("OV: W_V·W_O of each head"));
  EXPECT_THAT(svg, HasSubstr("QK: W_Q·W_Kᵀ of each head"));
  EXPECT_EQ(Count(svg, "index i of the singular value (descending)"), 2u);
  EXPECT_EQ(Count(svg, "(log scale)"), 2u);
  EXPECT_THAT(svg, HasSubstr(">head</text>"));   // the legend
  EXPECT_EQ(Count(svg, "stroke-width=\"3\""), 5u);  // one swatch per head
  EXPECT_THAT(svg, HasSubstr("<title>head 4: σ1="));
  EXPECT_THAT(svg, HasSubstr("10<tspan dy=\"-6\" font-size=\"9\">"));  // decade labels
  EXPECT_THAT(svg, Not(HasSubstr("nan")));
  EXPECT_THAT(svg, Not(HasSubstr("inf")));
  EXPECT_THAT(svg, Not(HasSubstr("numerical zeros")));

  // A zero singular value (a rank-deficient head) is left out, and the plot says so.
  const auto wide = MustLoad(store, "wide", "random:d_model=8,heads=2,d_head=8,kv_heads=1,bias=false");
  ASSERT_NE(wide, nullptr);
  v1::LayerInfo zeros = Describe(*wide, true);
  zeros.mutable_ov_spectrum(0)->set_singular_values(7, 0.0);
  const std::string z = cli::SpectrumSvg(zeros);
  EXPECT_TRUE(TagsBalance(z, &why)) << why;
  EXPECT_THAT(z, HasSubstr("numerical zeros"));

  // Many heads: the legend wraps into columns and every head keeps a colour.
  const auto many = MustLoad(store, "many", "random:d_model=64,heads=32,d_head=2,kv_heads=8,summed=false");
  ASSERT_NE(many, nullptr);
  const std::string m = cli::SpectrumSvg(Describe(*many, true));
  EXPECT_TRUE(TagsBalance(m, &why)) << why;
  EXPECT_EQ(Count(m, "<polyline"), 64u);
  EXPECT_THAT(m, HasSubstr("hsl(348, 70%"));
}

TEST(SpectrumView, LowRankSummaryComparesWithTheFactoredForm) {
  LayerStore store(&Cpu());
  const auto layer = MustLoad(store, "s", "random:d_model=64,heads=4,d_head=16,lowrank=budget:8");
  ASSERT_NE(layer, nullptr);
  const v1::LayerInfo info = Describe(*layer, false);
  const std::string line = cli::LowRankSummary(info);
  EXPECT_THAT(line, HasSubstr("lowrank: selection=budget:8 ranks="));
  EXPECT_THAT(line, HasSubstr(" total_rank=8 kept_energy=0."));
  EXPECT_THAT(line, HasSubstr(" params_vs_factored=0."));
  EXPECT_THAT(line, HasSubstr(" flops_vs_factored=0."));
  EXPECT_EQ(cli::LowRankSummary(Describe(*MustLoad(store, "p", "random:d_model=16,heads=2"), false)), "");
}

// lowrank=divergence: on the wire and in the CLI's layer listing: each head's rank, kept energy
// and calibration divergence, as the store computed them.
TEST(SpectrumView, CalibratedRanksPerHeadOnTheWireAndInTheListing) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("attnserve_calib_" + std::to_string(getpid()) + ".npy")).string();
  NpyArray rows{{64, 16}, {}};
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < 64 * 16; ++i) rows.data.push_back(normal(rng) * static_cast<float>(1 + i % 16));
  ASSERT_TRUE(WriteNpy(path, rows).ok());
  LayerStore store(&Cpu());
  const auto layer = MustLoad(store, "c", "random:d_model=16,heads=2,d_head=8,lowrank=divergence:0.2,calibration=" + path);
  std::filesystem::remove(path);
  ASSERT_NE(layer, nullptr);
  const v1::LayerInfo info = Describe(*layer, false);
  const v1::FormInfo* lowrank = nullptr;
  for (const v1::FormInfo& f : info.forms()) {
    if (f.form() == v1::FORM_LOWRANK) lowrank = &f;
  }
  ASSERT_NE(lowrank, nullptr);
  ASSERT_EQ(lowrank->ranks_size(), 2);
  ASSERT_EQ(lowrank->head_kept_energy_size(), 2);
  ASSERT_EQ(lowrank->head_divergence_size(), 2);
  EXPECT_EQ(lowrank->calibration_rows(), 64);
  EXPECT_EQ(lowrank->calibration_divergence(), layer->lowrank_calibration_divergence);
  EXPECT_LE(lowrank->calibration_divergence(), 0.2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(lowrank->ranks(i), layer->lowrank_ranks[i]);
    EXPECT_EQ(lowrank->head_divergence(i), layer->lowrank_head_divergence[i]);
    EXPECT_NEAR(lowrank->head_kept_energy(i), 1 - lowrank->head_divergence(i) * lowrank->head_divergence(i), 1e-12);
  }
  const std::string text = cli::LowRankSummary(info);
  EXPECT_THAT(text, HasSubstr("lowrank: selection=divergence:0.2 ranks="));
  EXPECT_THAT(text, HasSubstr(" calibration_rows=64"));
  EXPECT_THAT(text, HasSubstr("\nHEAD RANK KEPT_ENERGY DIVERGENCE\n0 " + std::to_string(lowrank->ranks(0)) + " "));
  // energy: lists each head's rank and kept energy, with no divergence column.
  const std::string energy = cli::LowRankSummary(Describe(*MustLoad(store, "e", "random:d_model=16,heads=2,lowrank=energy:0.9"), false));
  EXPECT_THAT(energy, HasSubstr("\nHEAD RANK KEPT_ENERGY\n0 "));
  EXPECT_THAT(energy, Not(HasSubstr("calibration")));
}

// calibration=live:ROWS before its form is built: the wire's live_calibration and the listing's
// line, with the rows seen so far and a failed build's error.
TEST(SpectrumView, ALiveCalibrationShowsItsRowsUntilBuilt) {
  LayerStore store(&Cpu());
  const auto layer = MustLoad(store, "live", "random:d_model=16,heads=2,lowrank=divergence:0.2,calibration=live:40");
  ASSERT_NE(layer, nullptr);
  std::vector<float> x(24 * 16);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  Sequence s;
  s.input = ConstMatrixView{x.data(), 24, 16};
  EXPECT_FALSE(layer->live_calibration->Offer(std::span(&s, 1)));
  v1::LayerInfo info = Describe(*layer, false);
  ASSERT_TRUE(info.has_live_calibration());
  EXPECT_EQ(info.live_calibration().rank_selection(), "divergence:0.2");
  EXPECT_EQ(info.live_calibration().rows_wanted(), 40);
  EXPECT_EQ(info.live_calibration().rows_seen(), 24);
  EXPECT_EQ(info.live_calibration().error(), "");
  EXPECT_EQ(cli::LowRankSummary(info),
            "lowrank: selection=divergence:0.2 calibration=live rows_seen=24 rows_wanted=40 (not built yet)\n");
  layer->live_calibration->Fail(ResourceExhaustedError("no room"));
  info = Describe(*layer, false);
  EXPECT_EQ(info.live_calibration().error(), "no room");
  EXPECT_THAT(cli::LowRankSummary(info), HasSubstr(" error=no room"));
  EXPECT_FALSE(Describe(*MustLoad(store, "e", "random:d_model=16,heads=2,lowrank=energy:0.9"), false).has_live_calibration());
}

TEST(SpectrumView, LayerArguments) {
  cli::LayerArgs a;
  std::string error;
  ASSERT_TRUE(cli::ParseLayerArgs({"x"}, &a, &error)) << error;
  EXPECT_EQ(a.name, "x");
  EXPECT_FALSE(a.spectrum);
  EXPECT_TRUE(a.plot.empty());
  ASSERT_TRUE(cli::ParseLayerArgs({"--spectrum", "x", "--plot", "p.svg"}, &a, &error)) << error;
  EXPECT_TRUE(a.spectrum);
  EXPECT_EQ(a.plot, "p.svg");
  ASSERT_TRUE(cli::ParseLayerArgs({"x", "--plot=q.svg"}, &a, &error)) << error;
  EXPECT_EQ(a.plot, "q.svg");
  EXPECT_FALSE(cli::ParseLayerArgs({}, &a, &error));
  EXPECT_EQ(error, "missing NAME");
  EXPECT_FALSE(cli::ParseLayerArgs({"x", "y"}, &a, &error));
  EXPECT_THAT(error, HasSubstr("'y'"));
  EXPECT_FALSE(cli::ParseLayerArgs({"x", "--plot="}, &a, &error));
  EXPECT_THAT(error, HasSubstr("--plot"));
  EXPECT_FALSE(cli::ParseLayerArgs({"x", "--plot"}, &a, &error));
  EXPECT_FALSE(cli::ParseLayerArgs({"x", "--spectra"}, &a, &error));
  EXPECT_THAT(error, HasSubstr("--spectra"));
}

// ---- The CLI against a service backed by a real store -------------------------------------------

class StoreService final : public v1::AttentionService::Service {
 public:
  explicit StoreService(LayerStore* store) : store_(store) {}
  grpc::Status GetLayer(grpc::ServerContext*, const v1::GetLayerRequest* req, v1::LayerInfo* info) override {
    const auto layer = store_->Get(req->name());
    if (layer == nullptr) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no layer '" + req->name() + "'");
    *info = Describe(*layer, req->include_spectrum());
    return grpc::Status::OK;
  }

 private:
  LayerStore* store_;
};

struct CliRun {
  int code;
  std::string out, err;
};

TEST(SpectrumCli, LayerSpectrumAndPlot) {
  LayerStore store(&Cpu());
  ASSERT_NE(MustLoad(store, "enc", "random:d_model=48,heads=6,d_head=8,seed=2,lowrank=energy:0.9"), nullptr);
  ASSERT_NE(MustLoad(store, "bare", "random:d_model=16,heads=2,spectrum=false"), nullptr);
  StoreService service(&store);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  const std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_GT(port, 0);
  const auto cli = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"--target", "127.0.0.1:" + std::to_string(port), "--timeout-ms", "5000"});
    std::ostringstream out, err;
    const int code = cli::RunCli(args, {}, out, err);
    return CliRun{code, out.str(), err.str()};
  };

  // Without flags: no spectra asked for, none printed; the low-rank line is there.
  CliRun r = cli({"layer", "enc"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("rope_theta: 0\n"));
  EXPECT_THAT(r.out, HasSubstr("form lowrank: params="));
  EXPECT_THAT(r.out, HasSubstr("lowrank: selection=energy:0.9 ranks="));
  EXPECT_THAT(r.out, Not(HasSubstr("OV spectrum")));

  const std::string plot = (std::filesystem::temp_directory_path() /
                            ("attnserve_spectrum_" + std::to_string(::getpid()) + ".svg")).string();
  r = cli({"layer", "enc", "--spectrum", "--plot", plot});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("OV spectrum: W_V·W_O per query head (8 singular values per head"));
  EXPECT_THAT(r.out, HasSubstr("QK spectrum"));
  EXPECT_THAT(r.out, HasSubstr("plot: " + plot + "\n"));
  std::ifstream in(plot, std::ios::binary);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(plot);
  EXPECT_EQ(Count(svg, "<polyline"), 12u);
  EXPECT_THAT(svg, HasSubstr("Layer enc: singular values per head"));

  // --plot alone writes the file without the tables.
  r = cli({"layer", "enc", "--plot", plot});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, Not(HasSubstr("OV spectrum")));
  EXPECT_TRUE(std::filesystem::exists(plot));
  std::filesystem::remove(plot);

  // A layer without spectra, an unwritable file, a missing layer: exit 1 with the reason.
  r = cli({"layer", "bare", "--spectrum"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("no spectra for layer 'bare'"));
  EXPECT_THAT(r.err, HasSubstr("spectrum=false"));
  r = cli({"layer", "enc", "--plot", "/nonexistent-dir/x.svg"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("--plot: cannot write '/nonexistent-dir/x.svg'"));
  r = cli({"layer", "nope", "--spectrum"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND"));
  r = cli({"layer", "enc", "--plot"});
  EXPECT_EQ(r.code, 2);
  r = cli({"layer", "--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("--spectrum"));
  EXPECT_THAT(r.out, HasSubstr("--plot FILE.svg"));
  server->Shutdown();
}

}  // namespace
}  // namespace attnserve
