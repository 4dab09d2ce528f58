// A real checkpoint through the store: all six attention layers of all-MiniLM-L6-v2 (BERT,
// d_model 384, 12 heads; scripts/fetch-model puts it in the cache), loaded with
// `safetensors:PATH,arch=bert,index=I,lowrank=energy:E`, against an independent float64
// computation of the same layers from the same file (tests/tools/attention_reference.py, numpy
// only, its own safetensors reader): the factored and summed forms against the exact layer, the
// low-rank form against numpy's own truncation of each head's W_V·W_O by the same energy rule,
// and the store's spectra against numpy's SVD of the d×d products. E = 0.999 keeps all 32
// directions of every head of this model (docs/spectra.md), so E = 0.9 is checked as well: there
// the truncation is real.
//
// Without the model the test FAILS, saying to run scripts/fetch-model: a test that passes
// without checking anything would hide a broken setup.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/store/layer_store.h"
#include "server/store/safetensors.h"
#include "tests/unit/test_support.h"
#include "tests/unit/temp_dir.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;

constexpr int kLayers = 6;
constexpr int64_t kDModel = 384, kHeads = 12, kDHead = 32;
// The low-rank energies checked, as the source writes them.
constexpr const char* kEnergies[] = {"0.999", "0.9"};
constexpr size_t kEnergyCount = std::size(kEnergies);
constexpr double kTolerance = 1e-5;

Backend& Cpu() {
  static CpuBackend backend;
  return backend;
}

// Where scripts/fetch-model puts the model: ${ATTNSERVE_CACHE:-$HOME/.cache/attnserve}/all-minilm-l6-v2.
fs::path ModelDir() {
  if (const char* cache = std::getenv("ATTNSERVE_CACHE"); cache != nullptr && *cache != '\0') {
    return fs::path(cache) / "all-minilm-l6-v2";
  }
  const char* home = std::getenv("HOME");
  return fs::path(home != nullptr ? home : "/root") / ".cache" / "attnserve" / "all-minilm-l6-v2";
}

// The Python with numpy (Debian's, from scripts/setup); $ATTNSERVE_PYTHON overrides.
std::string Python() {
  if (const char* p = std::getenv("ATTNSERVE_PYTHON"); p != nullptr && *p != '\0') return p;
  return ATTNSERVE_NUMPY_PYTHON;
}

std::string Quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs a shell command; returns its exit status and puts its output (stdout and stderr) in *output.
int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  size_t got = 0;
  while ((got = std::fread(buf, 1, sizeof buf, pipe)) > 0) output->append(buf, got);
  return ::pclose(pipe);
}

void WriteF32Safetensors(const std::string& path, const std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(t.second.data()), t.second.size() * sizeof(float));  // x86: little-endian
    header[name] = {{"dtype", "F32"}, {"shape", t.first}, {"data_offsets", {begin, data.size()}}};
  }
  const std::string h = header.dump();
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h.size() >> (8 * i)) & 0xff));
  std::ofstream f(path, std::ios::binary);
  f << out << h << data;
}

struct Case {
  std::string name;
  int64_t n = 0, m = 0;
  bool cross = false, causal = false;
  int64_t key_length = -1;
  std::vector<float> input, context;
};

using testing::TempDir;

double RelativeL2(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

std::vector<double> Widened(const std::vector<float>& v) { return {v.begin(), v.end()}; }

TEST(RealModel, AllMiniLmLayersMatchAnIndependentFloat64Computation) {
  const fs::path dir = ModelDir();
  const std::string model = (dir / "model.safetensors").string();
  ASSERT_TRUE(fs::is_regular_file(model) && fs::is_regular_file(dir / "config.json"))
      << "the all-MiniLM-L6-v2 checkpoint is missing: expected " << model << " and " << (dir / "config.json").string()
      << ". Run scripts/fetch-model (scripts/setup runs it; it honours $ATTNSERVE_CACHE) to download it.";
  std::string probe;
  ASSERT_EQ(RunCommand(Quoted(Python()) + " -c 'import numpy'", &probe), 0)
      << "the independent computation needs Python with numpy: '" << Python() << "' failed (" << probe
      << "). Run scripts/setup (it installs python3-numpy) or point $ATTNSERVE_PYTHON at a Python with numpy.";

  // Inputs: self-attention, causal, key padding and cross-attention, as one ragged batch.
  std::mt19937_64 rng(testing::TestSeed());
  std::vector<Case> cases = {{"self", 16, 16, false, false, -1, {}, {}},
                             {"causal", 20, 20, false, true, -1, {}, {}},
                             {"padded", 13, 13, false, false, 9, {}, {}},
                             {"cross", 5, 11, true, false, -1, {}, {}}};
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>> inputs;
  nlohmann::json spec = {{"heads", kHeads}, {"energies", nlohmann::json::array()},
                         {"layers", nlohmann::json::array()}, {"cases", nlohmann::json::array()}};
  for (const char* e : kEnergies) spec["energies"].push_back(std::stod(e));
  for (int l = 0; l < kLayers; ++l) spec["layers"].push_back(l);
  for (Case& c : cases) {
    c.input = testing::RandomVector(rng, c.n * kDModel);
    inputs[c.name + ".input"] = {{c.n, kDModel}, c.input};
    if (c.cross) {
      c.context = testing::RandomVector(rng, c.m * kDModel);
      inputs[c.name + ".context"] = {{c.m, kDModel}, c.context};
    }
    spec["cases"].push_back({{"name", c.name}, {"causal", c.causal}, {"key_length", c.key_length}, {"cross", c.cross}});
  }
  TempDir tmp;
  WriteF32Safetensors(tmp.File("inputs.safetensors"), inputs);
  std::ofstream(tmp.File("cases.json")) << spec.dump();
  const std::string script = std::string(ATTNSERVE_TEST_TOOLS_DIR) + "/attention_reference.py";
  std::string log;
  const int rc = RunCommand(Quoted(Python()) + " " + Quoted(script) + " " + Quoted(model) + " " + Quoted(tmp.File("cases.json")) +
                         " " + Quoted(tmp.File("inputs.safetensors")) + " " + Quoted(tmp.File("expected.safetensors")),
                     &log);
  ASSERT_EQ(rc, 0) << script << " failed:\n" << log;
  auto expected = ReadSafetensors(tmp.File("expected.safetensors"));
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  const auto want = [&](const std::string& name) {
    auto t = expected->ReadFloat(name);
    EXPECT_TRUE(t.ok()) << name << ": " << t.status().ToString();
    return t.ok() ? Widened(t->values) : std::vector<double>();
  };

  LayerStore store(&Cpu());
  std::ostringstream table;
  table << "layer  form                worst rel L2 vs numpy   lowrank vs exact   ranks (of " << kDHead << ")\n";
  for (int l = 0; l < kLayers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const std::string L = "L" + std::to_string(l);
    // One layer per energy; the first also serves the exact forms.
    std::vector<std::shared_ptr<const Layer>> layers;
    for (const char* energy : kEnergies) {
      const std::string source = "safetensors:" + model + ",arch=bert,index=" + std::to_string(l) +
                                 ",lowrank=energy:" + energy + (layers.empty() ? "" : ",summed=false");
      auto loaded = store.Load("minilm." + std::to_string(l) + ".e" + energy, source);
      ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
      layers.push_back(*loaded);
    }
    const Layer& layer = *layers[0];
    // Heads from the config.json beside the file; widths from the tensors.
    EXPECT_EQ(layer.config.d_model, kDModel);
    EXPECT_EQ(layer.config.heads, kHeads);
    EXPECT_EQ(layer.config.kv_heads, kHeads);
    EXPECT_EQ(layer.config.d_head, kDHead);
    EXPECT_TRUE(layer.config.bias);
    EXPECT_EQ(layer.config.rope_theta, 0.0);
    ASSERT_NE(layer.spectrum, nullptr);
    for (Form form : kAllForms) ASSERT_NE(layer.Find(form), nullptr) << FormName(form);

    // The spectra: QR + small SVD against numpy's full SVD (float32 in the file: ~1e-7).
    for (const char* side : {"ov", "qk"}) {
      const std::vector<double> sv = want(L + "." + side + "_sv");
      ASSERT_EQ(sv.size(), static_cast<size_t>(kHeads * kDHead));
      const auto& ours = std::string(side) == "ov" ? layer.spectrum->ov : layer.spectrum->qk;
      for (int64_t i = 0; i < kHeads; ++i) {
        const std::vector<double> head(sv.begin() + i * kDHead, sv.begin() + (i + 1) * kDHead);
        ASSERT_EQ(ours[i].singular_values.size(), static_cast<size_t>(kDHead));
        EXPECT_LT(RelativeL2(ours[i].singular_values, head), 1e-6) << side << " head " << i;
      }
    }

    // The low-rank ranks: numpy's SVD of the d×d product, by the same energy rule.
    for (size_t e = 0; e < kEnergyCount; ++e) {
      const std::vector<double> ranks = want(L + ".ranks." + std::to_string(e));
      ASSERT_EQ(ranks.size(), static_cast<size_t>(kHeads));
      ASSERT_EQ(layers[e]->lowrank_ranks.size(), static_cast<size_t>(kHeads));
      for (int64_t i = 0; i < kHeads; ++i) {
        EXPECT_EQ(layers[e]->lowrank_ranks[i], static_cast<int64_t>(ranks[i])) << "energy " << kEnergies[e] << " head " << i;
      }
    }

    // Every form over the batch; the row name says which layer and form computed it.
    struct Row {
      std::string name;
      const ResidentForm* form;
      std::string want_suffix;  // "exact" or "lowrank.K"
      const Layer* layer;
    };
    std::vector<Row> rows = {{"factored", layer.Find(Form::kFactored), "exact", &layer},
                             {"summed", layer.Find(Form::kSummed), "exact", &layer}};
    for (size_t e = 0; e < kEnergyCount; ++e) {
      rows.push_back({std::string("lowrank energy:") + kEnergies[e], layers[e]->Find(Form::kLowRank),
                      "lowrank." + std::to_string(e), layers[e].get()});
    }
    for (const Row& row : rows) {
      std::vector<std::vector<float>> outs;
      std::vector<Sequence> batch;
      for (const Case& c : cases) outs.emplace_back(c.n * kDModel, std::nanf(""));
      for (size_t k = 0; k < cases.size(); ++k) {
        const Case& c = cases[k];
        Sequence s;
        s.input = ConstMatrixView(c.input.data(), c.n, kDModel);
        if (c.cross) s.context = ConstMatrixView(c.context.data(), c.m, kDModel);
        s.causal = c.causal;
        s.key_length = c.key_length;
        s.output = MatrixView(outs[k].data(), c.n, kDModel);
        batch.push_back(s);
      }
      const Status st = Cpu().Forward(*row.form, batch);
      ASSERT_TRUE(st.ok()) << row.name << ": " << st.ToString();
      double worst = 0, vs_exact = 0;
      for (size_t k = 0; k < cases.size(); ++k) {
        const std::string prefix = L + "." + cases[k].name + ".";
        const double err = RelativeL2(Widened(outs[k]), want(prefix + row.want_suffix));
        EXPECT_LT(err, kTolerance) << row.name << ", case " << cases[k].name;
        worst = std::max(worst, err);
        vs_exact = std::max(vs_exact, RelativeL2(Widened(outs[k]), want(prefix + "exact")));
      }
      std::string rank_list;
      for (int64_t r : row.layer->lowrank_ranks) rank_list += (rank_list.empty() ? "" : ",") + std::to_string(r);
      table << std::setw(5) << l << "  " << std::left << std::setw(20) << row.name << std::right << std::scientific
            << std::setprecision(1) << std::setw(20) << worst << std::setw(19) << vs_exact << std::defaultfloat << "   "
            << (row.want_suffix == "exact" ? "-" : rank_list) << "\n";
    }
  }
  std::cout << table.str();
}

}  // namespace
}  // namespace attnserve
