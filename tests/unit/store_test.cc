// attnserve::store: the SOURCE grammar, the three checkpoint layouts against PyTorch's own
// nn.MultiheadAttention (tests/data/torch-mha), what an API load may open beneath a model dir,
// and LayerStore's load / replace / unload under its caps and concurrent readers.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "server/backend/cpu/cpu_backend.h"
#include "server/core/form_table.h"
#include "server/core/reference.h"
#include "server/store/arch/arch.h"
#include "server/store/checkpoint_file.h"
#include "server/store/layer_store.h"
#include "server/store/safetensors.h"
#include "server/store/source.h"
#include "tests/unit/temp_dir.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kTorchDir = std::string(ATTNSERVE_TEST_DATA_DIR) + "/torch-mha";
constexpr const char* kLayouts[] = {"torch-mha", "gpt2", "bert"};
constexpr double kOracleTolerance = 1e-5;

// One CpuBackend per process: its constructor sets Eigen's process-wide thread count.
Backend& Cpu() {
  static CpuBackend backend;
  return backend;
}

std::string LayoutPath(const std::string& layer, const std::string& layout) {
  return kTorchDir + "/" + layer + "." + layout + ".safetensors";
}

// ---- The manifest ----------------------------------------------------------------------------

struct CaseInfo {
  std::string name;
  bool causal = false;
  bool has_context = false;
  std::vector<int64_t> key_lengths;  // empty: all keys
};

struct OracleLayer {
  std::string name;
  int64_t d_model = 0, heads = 0, d_head = 0;
  std::vector<CaseInfo> cases;
};

std::vector<OracleLayer> ReadManifest() {
  std::ifstream in(kTorchDir + "/manifest.json");
  const Json m = Json::parse(in);
  std::vector<OracleLayer> layers;
  for (const auto& [name, l] : m.at("layers").items()) {
    OracleLayer layer;
    layer.name = name;
    layer.d_model = l.at("d_model").get<int64_t>();
    layer.heads = l.at("heads").get<int64_t>();
    layer.d_head = l.at("d_head").get<int64_t>();
    for (const auto& c : l.at("cases")) {
      CaseInfo ci;
      ci.name = c.at("name").get<std::string>();
      ci.causal = c.at("causal").get<bool>();
      ci.has_context = c.at("has_context").get<bool>();
      if (!c.at("key_lengths").is_null()) ci.key_lengths = c.at("key_lengths").get<std::vector<int64_t>>();
      layer.cases.push_back(ci);
    }
    layers.push_back(layer);
  }
  return layers;
}

// ---- Writing test checkpoints ------------------------------------------------------------------

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::string dtype = "F32";  // F32, or I64 (values written as integers)
};
using TensorMap = std::map<std::string, Tensor>;

void WriteSafetensors(const std::string& path, const TensorMap& tensors) {
  Json header = Json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    const size_t begin = data.size();
    for (float v : t.values) {
      uint64_t bits = 0;
      int bytes = 4;
      if (t.dtype == "I64") {
        bits = static_cast<uint64_t>(static_cast<int64_t>(v));
        bytes = 8;
      } else {
        uint32_t b32;
        std::memcpy(&b32, &v, 4);
        bits = b32;
      }
      for (int i = 0; i < bytes; ++i) data.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
    }
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  const std::string h = header.dump();
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h.size() >> (8 * i)) & 0xff));
  out += h + data;
  std::ofstream f(path, std::ios::binary);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
}

TensorMap ReadAll(const std::string& path) {
  auto file = ReadSafetensors(path);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  TensorMap out;
  if (!file.ok()) return out;
  for (const TensorInfo& t : file->tensors()) {
    auto v = file->ReadFloat(t.name);
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    if (v.ok()) out[t.name] = {v->shape, v->values};
  }
  return out;
}

TensorMap Renamed(const TensorMap& in, const std::string& prefix, float scale = 1.0f,
                  const std::string& replace_from = "", const std::string& replace_to = "") {
  TensorMap out;
  for (const auto& [original, tensor] : in) {
    std::string name = original;
    Tensor t = tensor;
    if (!replace_from.empty() && name.find(replace_from) != std::string::npos) {
      name.replace(name.find(replace_from), replace_from.size(), replace_to);
    }
    for (float& v : t.values) v *= scale;
    out[prefix + name] = t;
  }
  return out;
}

using testing::TempDir;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

// ---- Helpers ---------------------------------------------------------------------------------

void ExpectError(const Status& st, StatusCode code, const std::vector<std::string>& words, const std::string& what) {
  ASSERT_FALSE(st.ok()) << what << " was accepted";
  EXPECT_EQ(st.code(), code) << what << ": " << st.ToString();
  for (const auto& w : words) {
    EXPECT_NE(st.message().find(w), std::string::npos) << what << ": message lacks '" << w << "': " << st.message();
  }
}

LayerWeights MustLoad(const std::string& source) {
  auto s = LoadSource(source);
  EXPECT_TRUE(s.ok()) << source << ": " << s.status().ToString();
  return s.ok() ? s->weights : LayerWeights();
}

void ExpectSameWeights(const LayerWeights& a, const LayerWeights& b, const std::string& what) {
  EXPECT_EQ(a.config.ToString(), b.config.ToString()) << what;
  EXPECT_EQ(a.w_q, b.w_q) << what;
  EXPECT_EQ(a.w_k, b.w_k) << what;
  EXPECT_EQ(a.w_v, b.w_v) << what;
  EXPECT_EQ(a.w_o, b.w_o) << what;
  EXPECT_EQ(a.b_q, b.b_q) << what;
  EXPECT_EQ(a.b_k, b.b_k) << what;
  EXPECT_EQ(a.b_v, b.b_v) << what;
  EXPECT_EQ(a.b_o, b.b_o) << what;
}

// One oracle case through a form: each batch row becomes one Sequence. Returns the relative L2
// error of the whole output against PyTorch's (infinity when the forward fails).
double RunCase(const ResidentForm& form, const SafetensorsFile& cases, const CaseInfo& c, int64_t d,
               const LayerWeights* reference_weights = nullptr) {
  auto input = cases.ReadFloat(c.name + ".input");
  auto want = cases.ReadFloat(c.name + ".output");
  EXPECT_TRUE(input.ok() && want.ok()) << c.name;
  if (!input.ok() || !want.ok()) return INFINITY;
  std::optional<FloatTensor> context;
  if (c.has_context) {
    auto ctx = cases.ReadFloat(c.name + ".context");
    EXPECT_TRUE(ctx.ok()) << c.name;
    if (!ctx.ok()) return INFINITY;
    context = std::move(*ctx);
  }
  const int64_t batch = input->shape[0], n = input->shape[1];
  const int64_t m = context ? context->shape[1] : n;
  EXPECT_EQ(input->shape[2], d);
  if (!c.key_lengths.empty()) {
    EXPECT_EQ(static_cast<int64_t>(c.key_lengths.size()), batch);
  }
  std::vector<float> got(want->values.size(), std::nanf(""));
  std::vector<Sequence> seqs;
  for (int64_t r = 0; r < batch; ++r) {
    Sequence s;
    s.input = ConstMatrixView(input->values.data() + r * n * d, n, d);
    if (context) s.context = ConstMatrixView(context->values.data() + r * m * d, m, d);
    s.causal = c.causal;
    s.key_length = c.key_lengths.empty() ? -1 : c.key_lengths[r];
    s.output = MatrixView(got.data() + r * n * d, n, d);
    seqs.push_back(s);
  }
  if (reference_weights != nullptr) {
    // The float64 reference of server/core, written from the definition: checks the weights
    // mapping independently of every backend.
    std::vector<double> ref;
    for (const Sequence& s : seqs) {
      const std::vector<double> y = ReferenceForward(*reference_weights, s);
      ref.insert(ref.end(), y.begin(), y.end());
    }
    std::vector<float> ref_f(ref.begin(), ref.end());
    return testing::RelativeL2(ref_f.data(), want->values.data(), ref_f.size());
  }
  const Status st = Cpu().Forward(form, seqs);
  EXPECT_TRUE(st.ok()) << c.name << ": " << st.ToString();
  if (!st.ok()) return INFINITY;
  return testing::RelativeL2(got.data(), want->values.data(), got.size());
}

// ---- The PyTorch oracle ------------------------------------------------------------------------

TEST(TorchOracle, EveryLayoutAndFormMatchesPyTorch) {
  const std::vector<OracleLayer> layers = ReadManifest();
  ASSERT_EQ(layers.size(), 2u);
  std::map<std::string, double> worst;  // "layout / form" -> worst relative L2 over every case
  int cases_run = 0;
  for (const OracleLayer& layer : layers) {
    auto cases = ReadSafetensors(kTorchDir + "/" + layer.name + ".cases.safetensors");
    ASSERT_TRUE(cases.ok()) << cases.status().ToString();
    for (const char* layout : kLayouts) {
      const std::string source = "safetensors:" + LayoutPath(layer.name, layout) + ",heads=" + std::to_string(layer.heads);
      LayerStore store(&Cpu());
      auto loaded = store.Load(layer.name + "." + layout, source);
      ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
      const Layer& l = **loaded;
      EXPECT_EQ(l.config.d_model, layer.d_model);
      EXPECT_EQ(l.config.heads, layer.heads);
      EXPECT_EQ(l.config.kv_heads, layer.heads);
      EXPECT_EQ(l.config.d_head, layer.d_head);
      EXPECT_TRUE(l.config.bias);
      EXPECT_EQ(l.device, "cpu");
      for (Form form : {Form::kFactored, Form::kSummed}) {
        const ResidentForm* resident = l.Find(form);
        ASSERT_NE(resident, nullptr) << FormName(form);
        const std::string key = std::string(layout) + " / " + std::string(FormName(form));
        for (const CaseInfo& c : layer.cases) {
          const double err = RunCase(*resident, *cases, c, layer.d_model);
          EXPECT_LT(err, kOracleTolerance) << layer.name << " " << key << " " << c.name;
          worst[key] = std::max(worst[key], err);
          ++cases_run;
        }
      }
      // The float64 definition over the same weights.
      const LayerWeights w = MustLoad(source);
      const std::string key = std::string(layout) + " / float64 reference";
      for (const CaseInfo& c : layer.cases) {
        const double err = RunCase(*l.Find(Form::kFactored), *cases, c, layer.d_model, &w);
        EXPECT_LT(err, kOracleTolerance) << layer.name << " " << key << " " << c.name;
        worst[key] = std::max(worst[key], err);
      }
    }
  }
  EXPECT_EQ(cases_run, 2 * 3 * 2 * 6);
  std::cout << "worst relative L2 vs PyTorch over both layers and every case:\n";
  for (const auto& [key, err] : worst) std::cout << "  " << key << ": " << err << "\n";
}

TEST(TorchOracle, ThreeLayoutsGiveIdenticalWeights) {
  for (const OracleLayer& layer : ReadManifest()) {
    const std::string heads = ",heads=" + std::to_string(layer.heads);
    std::vector<LayerWeights> w;
    for (const char* layout : kLayouts) {
      // The layout is detected from the tensor names when arch= is not given.
      auto s = LoadSource("safetensors:" + LayoutPath(layer.name, layout) + heads);
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      EXPECT_EQ(CheckpointArchName(s->arch), layout);
      w.push_back(s->weights);
      // arch= given explicitly reads the same.
      ExpectSameWeights(MustLoad("safetensors:" + LayoutPath(layer.name, layout) + heads + ",arch=" + layout),
                        w.back(), layout);
    }
    ExpectSameWeights(w[0], w[1], layer.name + ": torch-mha vs gpt2");
    ExpectSameWeights(w[0], w[2], layer.name + ": torch-mha vs bert");
  }
}

// ---- Heads from config.json ---------------------------------------------------------------------

TEST(Sources, HeadsFromConfigJson) {
  TempDir dir;
  const LayerWeights want = MustLoad("safetensors:" + LayoutPath("small", "bert") + ",heads=4");
  WriteSafetensors(dir.File("model.safetensors"), ReadAll(LayoutPath("small", "bert")));
  const std::string source = "safetensors:" + dir.File("model.safetensors");

  // No heads anywhere: the error says where it looked and what to add.
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "heads=H"}, "no heads");

  WriteText(dir.File("config.json"), R"({"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4})");
  ExpectSameWeights(MustLoad(source), want, "num_attention_heads");

  WriteText(dir.File("config.json"), R"({"n_head": 4, "n_embd": 64})");
  ExpectSameWeights(MustLoad(source), want, "n_head");

  // The source's heads= wins over config.json.
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8})");
  EXPECT_EQ(MustLoad(source + ",heads=4").config.heads, 4);
  EXPECT_EQ(MustLoad(source).config.heads, 8);

  WriteText(dir.File("config.json"), R"({"num_attention_heads": 3})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"heads=3", "query.weight"}, "heads 3");

  WriteText(dir.File("config.json"), R"({"num_attention_heads": "4"})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "num_attention_heads"},
              "string heads");
  WriteText(dir.File("config.json"), R"({"hidden_size": 64})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "n_head", "heads="},
              "no heads key");
  WriteText(dir.File("config.json"), "{oops");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "not valid JSON"}, "bad json");
}

// ---- Layouts under prefixes, several blocks, odd files ----------------------------------------

TEST(Sources, Gpt2UnderTransformerPrefixWithSeveralBlocks) {
  TempDir dir;
  const TensorMap gpt2 = ReadAll(LayoutPath("small", "gpt2"));
  TensorMap file = Renamed(gpt2, "transformer.");
  const TensorMap block1 = Renamed(gpt2, "transformer.", 0.5f, "h.0.", "h.1.");
  file.insert(block1.begin(), block1.end());
  // What a real GPT-2 checkpoint also holds: the causal-mask buffer, embeddings, integer ids.
  file["transformer.h.0.attn.bias"] = {{1, 1, 2, 2}, {1, 0, 1, 1}};
  file["transformer.wte.weight"] = {{3, 64}, std::vector<float>(3 * 64, 0.25f)};
  file["transformer.position_ids"] = {{3}, {0, 1, 2}, "I64"};
  const std::string path = dir.File("gpt2.safetensors");
  WriteSafetensors(path, file);

  const LayerWeights base = MustLoad("safetensors:" + LayoutPath("small", "gpt2") + ",heads=4");
  ExpectSameWeights(MustLoad("safetensors:" + path + ",heads=4"), base, "index 0 by default");
  ExpectSameWeights(MustLoad("safetensors:" + path + ",heads=4,index=0,prefix=transformer.,arch=gpt2"), base,
                    "everything explicit");
  LayerWeights half = base;
  for (auto* v : {&half.w_q, &half.w_k, &half.w_v, &half.w_o, &half.b_q, &half.b_k, &half.b_v, &half.b_o}) {
    for (float& x : *v) x *= 0.5f;
  }
  ExpectSameWeights(MustLoad("safetensors:" + path + ",heads=4,index=1"), half, "index 1");
  ExpectError(LoadSource("safetensors:" + path + ",heads=4,index=2").status(), StatusCode::kNotFound,
              {path, "index=2", "0..1"}, "index 2");
  ExpectError(LoadSource("safetensors:" + path + ",heads=4,prefix=model.").status(), StatusCode::kNotFound,
              {path, "prefix 'model.'"}, "wrong prefix");
}

TEST(Sources, BertUnderBertPrefixIsDetected) {
  TempDir dir;
  const std::string path = dir.File("bert.safetensors");
  TensorMap file = Renamed(ReadAll(LayoutPath("small", "bert")), "bert.");
  file["bert.embeddings.position_ids"] = {{1, 4}, {0, 1, 2, 3}, "I64"};
  WriteSafetensors(path, file);
  auto s = LoadSource("safetensors:" + path + ",heads=4");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->arch, CheckpointArch::kBert);
  ExpectSameWeights(s->weights, MustLoad("safetensors:" + LayoutPath("small", "bert") + ",heads=4"), "bert.");
}

TEST(Sources, TorchMhaPrefixes) {
  TempDir dir;
  const TensorMap mha = ReadAll(LayoutPath("small", "torch-mha"));
  const LayerWeights base = MustLoad("safetensors:" + LayoutPath("small", "torch-mha") + ",heads=4");
  // One nn.MultiheadAttention inside a bigger module: its prefix is found.
  const std::string one = dir.File("one.safetensors");
  WriteSafetensors(one, Renamed(mha, "encoder.self_attn."));
  ExpectSameWeights(MustLoad("safetensors:" + one + ",heads=4"), base, "one prefixed module");
  // Two of them: the choice is the user's.
  TensorMap two = Renamed(mha, "layers.0.self_attn.");
  const TensorMap second = Renamed(mha, "layers.1.self_attn.", 2.0f);
  two.insert(second.begin(), second.end());
  const std::string path = dir.File("two.safetensors");
  WriteSafetensors(path, two);
  ExpectError(LoadSource("safetensors:" + path + ",heads=4").status(), StatusCode::kInvalidArgument,
              {path, "several prefixes", "layers.0.self_attn.", "prefix="}, "two modules");
  ExpectSameWeights(MustLoad("safetensors:" + path + ",heads=4,prefix=layers.0.self_attn."), base, "module 0");
  EXPECT_EQ(MustLoad("safetensors:" + path + ",heads=4,prefix=layers.1.self_attn.").w_q[0], 2.0f * base.w_q[0]);
}

TEST(Sources, OddCheckpoints) {
  TempDir dir;
  const TensorMap mha = ReadAll(LayoutPath("small", "torch-mha"));
  const TensorMap bert = ReadAll(LayoutPath("small", "bert"));

  // Two layouts in one file: arch= picks.
  TensorMap mixed = mha;
  mixed.insert(bert.begin(), bert.end());
  const std::string mixed_path = dir.File("mixed.safetensors");
  WriteSafetensors(mixed_path, mixed);
  ExpectError(LoadSource("safetensors:" + mixed_path + ",heads=4").status(), StatusCode::kInvalidArgument,
              {"several layouts", "torch-mha", "bert", "arch="}, "mixed");
  EXPECT_TRUE(LoadSource("safetensors:" + mixed_path + ",heads=4,arch=bert").ok());

  // No attention tensors at all.
  const std::string other = dir.File("other.safetensors");
  WriteSafetensors(other, {{"foo.weight", {{2, 2}, {1, 2, 3, 4}}}});
  ExpectError(LoadSource("safetensors:" + other + ",heads=4").status(), StatusCode::kNotFound,
              {other, "cannot tell the layout", "in_proj_weight", "arch="}, "no layout");
  ExpectError(LoadSource("safetensors:" + LayoutPath("small", "torch-mha") + ",heads=4,arch=gpt2").status(),
              StatusCode::kNotFound, {"h.N.attn.c_attn.weight", "arch=gpt2"}, "wrong arch");

  // No biases at all: a bias-free layer.
  TensorMap no_bias = mha;
  no_bias.erase("in_proj_bias");
  no_bias.erase("out_proj.bias");
  const std::string nb = dir.File("nobias.safetensors");
  WriteSafetensors(nb, no_bias);
  const LayerWeights w = MustLoad("safetensors:" + nb + ",heads=4");
  EXPECT_FALSE(w.config.bias);
  EXPECT_TRUE(w.b_q.empty() && w.b_o.empty());

  // Some biases only.
  TensorMap partial = mha;
  partial.erase("out_proj.bias");
  const std::string pb = dir.File("partial.safetensors");
  WriteSafetensors(pb, partial);
  ExpectError(LoadSource("safetensors:" + pb + ",heads=4").status(), StatusCode::kInvalidArgument,
              {pb, "in_proj_bias", "out_proj.bias"}, "partial bias");

  // add_bias_kv has no place in our layer.
  TensorMap bias_kv = mha;
  bias_kv["bias_k"] = {{1, 1, 64}, std::vector<float>(64, 0.0f)};
  const std::string bk = dir.File("biaskv.safetensors");
  WriteSafetensors(bk, bias_kv);
  ExpectError(LoadSource("safetensors:" + bk + ",heads=4").status(), StatusCode::kInvalidArgument,
              {"bias_k", "add_bias_kv"}, "bias_k");

  // A tensor of the wrong shape.
  TensorMap bad_shape = bert;
  const std::string value = "encoder.layer.0.attention.self.value.weight";
  bad_shape[value] = {{32, 64}, std::vector<float>(32 * 64, 0.1f)};
  const std::string bs = dir.File("shape.safetensors");
  WriteSafetensors(bs, bad_shape);
  ExpectError(LoadSource("safetensors:" + bs + ",heads=4").status(), StatusCode::kInvalidArgument,
              {bs, value, "expected shape [64, 64]", "got [32, 64]"}, "bad shape");

  // A non-finite weight.
  TensorMap nan = mha;
  nan["in_proj_weight"].values[5] = std::nanf("");
  const std::string np = dir.File("nan.safetensors");
  WriteSafetensors(np, nan);
  ExpectError(LoadSource("safetensors:" + np + ",heads=4").status(), StatusCode::kInvalidArgument,
              {np, "in_proj_weight", "non-finite", "index 5"}, "nan");

  // A weight of an integer dtype.
  TensorMap ints = mha;
  ints["out_proj.bias"].dtype = "I64";
  const std::string ip = dir.File("ints.safetensors");
  WriteSafetensors(ip, ints);
  ExpectError(LoadSource("safetensors:" + ip + ",heads=4").status(), StatusCode::kInvalidArgument,
              {"out_proj.bias", "I64"}, "int dtype");

  // Missing files, impossible head counts.
  ExpectError(LoadSource("safetensors:" + dir.File("absent.safetensors") + ",heads=4").status(),
              StatusCode::kNotFound, {dir.File("absent.safetensors")}, "missing file");
  ExpectError(LoadSource("safetensors:" + LayoutPath("small", "gpt2") + ",heads=3").status(),
              StatusCode::kInvalidArgument, {"heads=3", "64"}, "heads 3");
  ExpectError(LoadSource("safetensors:" + LayoutPath("small", "gpt2") + ",heads=4,kv_heads=2").status(),
              StatusCode::kInvalidArgument, {"kv_heads=2", "4 key/value heads"}, "kv_heads 2");
  ExpectError(LoadSource("safetensors:" + LayoutPath("small", "gpt2") + ",heads=4,index=1").status(),
              StatusCode::kNotFound, {"index=1", "0..0"}, "index 1");
}

// Grouped-query attention from a bert-style file with narrower key/value projections: kv_heads
// is inferred from the widths, and the loaded layer agrees with the float64 definition.
TEST(Sources, GroupedQueryAttentionIsInferred) {
  TempDir dir;
  std::mt19937_64 rng(testing::TestSeed());
  const int64_t d = 32, q = 32, kv = 16;  // heads 4, d_head 8, kv_heads 2
  const std::string p = "encoder.layer.0.attention.";
  TensorMap t;
  t[p + "self.query.weight"] = {{q, d}, testing::RandomVector(rng, q * d, 0.2f)};
  t[p + "self.key.weight"] = {{kv, d}, testing::RandomVector(rng, kv * d, 0.2f)};
  t[p + "self.value.weight"] = {{kv, d}, testing::RandomVector(rng, kv * d, 0.2f)};
  t[p + "output.dense.weight"] = {{d, q}, testing::RandomVector(rng, d * q, 0.2f)};
  t[p + "self.query.bias"] = {{q}, testing::RandomVector(rng, q, 0.1f)};
  t[p + "self.key.bias"] = {{kv}, testing::RandomVector(rng, kv, 0.1f)};
  t[p + "self.value.bias"] = {{kv}, testing::RandomVector(rng, kv, 0.1f)};
  t[p + "output.dense.bias"] = {{d}, testing::RandomVector(rng, d, 0.1f)};
  const std::string path = dir.File("gqa.safetensors");
  WriteSafetensors(path, t);

  auto s = LoadSource("safetensors:" + path + ",heads=4");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->weights.config.kv_heads, 2);
  EXPECT_EQ(s->weights.config.d_head, 8);
  EXPECT_TRUE(LoadSource("safetensors:" + path + ",heads=4,kv_heads=2").ok());
  ExpectError(LoadSource("safetensors:" + path + ",heads=4,kv_heads=4").status(), StatusCode::kInvalidArgument,
              {"kv_heads=4", "self.key.weight"}, "kv_heads 4");
  // The transposition, spot-checked: W_K[i][j] = key.weight[j][i].
  EXPECT_EQ(s->weights.w_k[3 * kv + 5], t[p + "self.key.weight"].values[5 * d + 3]);

  LayerStore store(&Cpu());
  auto layer = store.Load("gqa", "safetensors:" + path + ",heads=4");
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  for (Form form : {Form::kFactored, Form::kSummed}) {
    testing::OwnedSequence seq = testing::RandomSequence(rng, d, 5, 7, /*cross=*/true, /*causal=*/true, 6);
    const Sequence view = seq.View();
    ASSERT_TRUE(Cpu().Forward(*(*layer)->Find(form), std::span<const Sequence>(&view, 1)).ok());
    const double err = testing::RelativeL2(seq.output.data(), ReferenceForward(s->weights, view));
    EXPECT_LT(err, 1e-5) << FormName(form);
  }
}

// ---- LLaMA-family checkpoints ---------------------------------------------------------------------

// A LLaMA-style layer written by hand: nn.Linear weights [out, in], no biases, grouped-query.
struct LlamaFile {
  int64_t d = 64, heads = 8, kv_heads = 2, d_head = 16;
  TensorMap tensors;
  LayerWeights want;  // the same layer in our convention, transposed here independently of the store
};

LlamaFile MakeLlama(std::mt19937_64& rng, const std::string& prefix, int64_t index) {
  LlamaFile f;
  const int64_t q = f.heads * f.d_head, kv = f.kv_heads * f.d_head, d = f.d;
  const std::string p = prefix + "layers." + std::to_string(index) + ".self_attn.";
  f.tensors[p + "q_proj.weight"] = {{q, d}, testing::RandomVector(rng, q * d, 0.15f)};
  f.tensors[p + "k_proj.weight"] = {{kv, d}, testing::RandomVector(rng, kv * d, 0.15f)};
  f.tensors[p + "v_proj.weight"] = {{kv, d}, testing::RandomVector(rng, kv * d, 0.15f)};
  f.tensors[p + "o_proj.weight"] = {{d, q}, testing::RandomVector(rng, d * q, 0.15f)};
  // What else a LLaMA checkpoint holds beside attention.
  f.tensors[prefix + "layers." + std::to_string(index) + ".mlp.gate_proj.weight"] = {{8, d}, std::vector<float>(8 * d, 0.5f)};
  f.tensors[prefix + "embed_tokens.weight"] = {{5, d}, std::vector<float>(5 * d, 0.25f)};
  const auto transposed = [](const Tensor& t) {
    std::vector<float> out(t.values.size());
    const int64_t rows = t.shape[0], cols = t.shape[1];
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = t.values[r * cols + c];
    }
    return out;
  };
  f.want.config = *CompleteConfig({.d_model = d, .heads = f.heads, .kv_heads = f.kv_heads, .d_head = f.d_head,
                                   .bias = false, .rope_theta = 500000.0});
  f.want.w_q = transposed(f.tensors[p + "q_proj.weight"]);
  f.want.w_k = transposed(f.tensors[p + "k_proj.weight"]);
  f.want.w_v = transposed(f.tensors[p + "v_proj.weight"]);
  f.want.w_o = transposed(f.tensors[p + "o_proj.weight"]);
  return f;
}

constexpr const char* kLlamaConfig =
    R"({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rope_theta": 500000.0, "rope_scaling": null, "max_position_embeddings": 4096})";

// Runs `form` and the float64 definition on causal self-attention at a position offset (and a
// cross-attention sequence); returns the worst relative L2 error.
double WorstAgainstReference(const ResidentForm& form, const LayerWeights& want, std::mt19937_64& rng) {
  double worst = 0;
  for (int64_t offset : {int64_t{0}, int64_t{37}, int64_t{4000}}) {
    for (bool cross : {false, true}) {
      testing::OwnedSequence seq = testing::RandomSequence(rng, want.config.d_model, 6, 9, cross, !cross, -1);
      seq.position_offset = offset;
      const Sequence view = seq.View();
      const Status st = Cpu().Forward(form, std::span<const Sequence>(&view, 1));
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok()) return INFINITY;
      worst = std::max(worst, testing::RelativeL2(seq.output.data(), ReferenceForward(want, view)));
    }
  }
  return worst;
}

TEST(Llama, RoundTripWithGroupedQueryAttentionAndRope) {
  TempDir dir;
  std::mt19937_64 rng(testing::TestSeed());
  LlamaFile f = MakeLlama(rng, "model.", 0);
  const LlamaFile other = MakeLlama(rng, "model.", 1);
  f.tensors.insert(other.tensors.begin(), other.tensors.end());
  const std::string path = dir.File("model.safetensors");
  WriteSafetensors(path, f.tensors);
  WriteText(dir.File("config.json"), kLlamaConfig);

  // Detected from the names; heads, kv_heads and rope_theta from config.json.
  auto s = LoadSource("safetensors:" + path);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->arch, CheckpointArch::kLlama);
  EXPECT_EQ(s->weights.config.heads, 8);
  EXPECT_EQ(s->weights.config.kv_heads, 2);
  EXPECT_EQ(s->weights.config.d_head, 16);
  EXPECT_FALSE(s->weights.config.bias);
  EXPECT_EQ(s->weights.config.rope_theta, 500000.0);
  ExpectSameWeights(s->weights, f.want, "llama layer 0");
  ExpectSameWeights(MustLoad("safetensors:" + path + ",arch=llama,prefix=model.,index=0"), f.want, "explicit");
  LayerWeights want1 = other.want;
  ExpectSameWeights(MustLoad("safetensors:" + path + ",index=1"), want1, "llama layer 1");

  // Every form the store holds computes what the float64 definition (with RoPE) computes.
  LayerStore store(&Cpu());
  auto layer = store.Load("llama", "safetensors:" + path + ",lowrank=energy:1");
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  EXPECT_EQ((*layer)->config.rope_theta, 500000.0);
  for (Form form : {Form::kFactored, Form::kSummed, Form::kLowRank}) {
    ASSERT_NE((*layer)->Find(form), nullptr) << FormName(form);
    EXPECT_LT(WorstAgainstReference(*(*layer)->Find(form), f.want, rng), 1e-5) << FormName(form);
  }
  // RoPE matters: without it the same weights give other outputs.
  LayerWeights no_rope = f.want;
  no_rope.config.rope_theta = 0;
  auto plain = store.Load("plain", "safetensors:" + path + ",rope_theta=0");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ((*plain)->config.rope_theta, 0.0);
  EXPECT_LT(WorstAgainstReference(*(*plain)->Find(Form::kFactored), no_rope, rng), 1e-5);
  EXPECT_GT(WorstAgainstReference(*(*plain)->Find(Form::kFactored), f.want, rng), 1e-2);
}

TEST(Llama, ConfigJsonAndOptions) {
  TempDir dir;
  std::mt19937_64 rng(testing::TestSeed() + 1);
  const LlamaFile f = MakeLlama(rng, "", 0);  // LlamaModel: no "model." prefix
  const std::string path = dir.File("model.safetensors");
  WriteSafetensors(path, f.tensors);
  const std::string source = "safetensors:" + path;

  // No config.json: heads= and rope_theta= must both come from the source.
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument,
              {path, "arch=llama", "config.json", "heads=H", "rope_theta=T"}, "no config.json");
  ExpectError(LoadSource(source + ",heads=8").status(), StatusCode::kInvalidArgument, {"rope_theta=T"},
              "no rope_theta");
  auto given = LoadSource(source + ",heads=8,rope_theta=500000");
  ASSERT_TRUE(given.ok()) << given.status().ToString();
  ExpectSameWeights(given->weights, f.want, "options only");
  EXPECT_EQ(MustLoad(source + ",heads=8,rope_theta=1e4,kv_heads=2").config.rope_theta, 10000.0);

  // config.json without rope_theta: Hugging Face's default, 10000.
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8, "num_key_value_heads": 2})");
  EXPECT_EQ(MustLoad(source).config.rope_theta, 10000.0);
  EXPECT_EQ(MustLoad(source + ",rope_theta=250000").config.rope_theta, 250000.0);
  // config.json's head counts are checked against the shapes.
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8, "num_key_value_heads": 4})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument,
              {"config.json", "num_key_value_heads=4", "k_proj.weight", "2 key/value heads"}, "kv mismatch");
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8, "head_dim": 8})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument,
              {"config.json", "head_dim=8", "q_proj.weight", "d_head=16"}, "head_dim mismatch");
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8, "head_dim": 16, "rope_theta": 1000000})");
  EXPECT_EQ(MustLoad(source).config.rope_theta, 1e6);
  // Scaled RoPE is refused, not silently computed as plain RoPE.
  WriteText(dir.File("config.json"),
            R"({"num_attention_heads": 8, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "rope_scaling", "llama3"},
              "rope_scaling");
  // transformers 5's config.json: the base under rope_parameters, no top-level rope_theta.
  WriteText(dir.File("config.json"),
            R"({"num_attention_heads": 8, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}})");
  EXPECT_EQ(MustLoad(source).config.rope_theta, 500000.0);
  WriteText(dir.File("config.json"),
            R"({"num_attention_heads": 8, "rope_theta": 500000, "rope_parameters": {"rope_theta": 500000.0}})");
  EXPECT_EQ(MustLoad(source).config.rope_theta, 500000.0);
  WriteText(dir.File("config.json"),
            R"({"num_attention_heads": 8, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3"}})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument,
              {"config.json", "rope_parameters", "llama3", "default"}, "scaled rope_parameters");
  WriteText(dir.File("config.json"),
            R"({"num_attention_heads": 8, "rope_theta": 10000, "rope_parameters": {"rope_theta": 500000.0}})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "disagree"},
              "two rope_theta");
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8, "rope_parameters": {"rope_theta": "big"}})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument,
              {"config.json", "rope_parameters.rope_theta", "\"big\""}, "string rope_parameters.rope_theta");
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8, "rope_parameters": 5})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "rope_parameters", "object"},
              "rope_parameters not an object");
  WriteText(dir.File("config.json"), R"({"num_attention_heads": 8, "rope_theta": "big"})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"config.json", "'rope_theta'", "\"big\""},
              "string rope_theta");
  WriteText(dir.File("config.json"), R"({"hidden_size": 64, "rope_theta": 10000})");
  ExpectError(LoadSource(source).status(), StatusCode::kInvalidArgument, {"num_attention_heads", "heads=H"},
              "no heads in config.json");

  // Biases: all four or none.
  TensorMap partial = f.tensors;
  partial["layers.0.self_attn.q_proj.bias"] = {{128}, std::vector<float>(128, 0.1f)};
  WriteSafetensors(path, partial);
  ExpectError(LoadSource(source + ",heads=8,rope_theta=10000").status(), StatusCode::kInvalidArgument,
              {"q_proj.bias", "k_proj.bias"}, "partial bias");
  // A wrong shape names the tensor.
  TensorMap bad = f.tensors;
  bad["layers.0.self_attn.v_proj.weight"] = {{16, 64}, std::vector<float>(16 * 64, 0.1f)};
  WriteSafetensors(path, bad);
  ExpectError(LoadSource(source + ",heads=8,rope_theta=10000").status(), StatusCode::kInvalidArgument,
              {"v_proj.weight", "expected shape [32, 64]", "got [16, 64]"}, "bad shape");
  // An odd d_head cannot carry the rotary pairs.
  WriteSafetensors(path, f.tensors);
  ExpectError(LoadSource(source + ",heads=128,rope_theta=10000").status(), StatusCode::kInvalidArgument,
              {"even d_head", "d_head=1"}, "odd d_head");
}

// ---- The spectrum and the low-rank form -----------------------------------------------------------

// A LLaMA checkpoint of a layer whose OV spectra are known by construction
// (testing::KnownSpectra), so the ranks and kept energies the store reports are checked against
// values worked out by hand, not against the spectrum code.
TEST(LowRank, StoreHoldsTheSpectrumAndTheLowRankForm) {
  LayerStore store(&Cpu());
  std::mt19937_64 rng(testing::TestSeed() + 2);
  const testing::KnownSpectra known;
  const LayerConfig config =
      *CompleteConfig({.d_model = 48, .heads = 6, .kv_heads = 3, .d_head = 8, .bias = false, .rope_theta = 10000.0});
  const LayerWeights w = testing::LayerWithSpectra(config, known.sigma, known.sigma, rng);
  TempDir dir;
  const auto transposed = [](const std::vector<float>& v, int64_t rows, int64_t cols) {
    Tensor t{{cols, rows}, std::vector<float>(v.size())};
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) t.values[c * rows + r] = v[r * cols + c];
    return t;
  };
  const std::string p = "model.layers.0.self_attn.";
  WriteSafetensors(dir.File("model.safetensors"), {{p + "q_proj.weight", transposed(w.w_q, 48, 48)},
                                                   {p + "k_proj.weight", transposed(w.w_k, 48, 24)},
                                                   {p + "v_proj.weight", transposed(w.w_v, 48, 24)},
                                                   {p + "o_proj.weight", transposed(w.w_o, 48, 48)}});
  WriteText(dir.File("config.json"), R"({"model_type": "llama", "hidden_size": 48, "num_attention_heads": 6,
                                         "num_key_value_heads": 3, "rope_theta": 10000.0})");
  const std::string base = "safetensors:" + dir.File("model.safetensors");
  ExpectSameWeights(MustLoad(base), w, "the constructed layer");

  // Every layer carries its spectrum, computed once at load: the constructed singular values.
  auto plain = store.Load("plain", base);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  ASSERT_NE((*plain)->spectrum, nullptr);
  ASSERT_EQ((*plain)->spectrum->ov.size(), 6u);
  ASSERT_EQ((*plain)->spectrum->qk.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    ASSERT_EQ((*plain)->spectrum->ov[i].singular_values.size(), 8u);
    ASSERT_EQ((*plain)->spectrum->qk[i].singular_values.size(), 8u);
    for (size_t t = 0; t < 8; ++t) {
      EXPECT_NEAR((*plain)->spectrum->ov[i].singular_values[t], known.sigma[i][t], 1e-6 * known.sigma[i][0]) << i;
      EXPECT_NEAR((*plain)->spectrum->qk[i].singular_values[t], known.sigma[i][t], 1e-6 * known.sigma[i][0]) << i;
    }
  }
  EXPECT_EQ((*plain)->Find(Form::kLowRank), nullptr);
  EXPECT_TRUE((*plain)->lowrank_ranks.empty());
  EXPECT_EQ(store.Get("plain")->spectrum, (*plain)->spectrum);  // the same object, not recomputed

  auto none = store.Load("none", base + ",spectrum=false");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->spectrum, nullptr);

  // Full energy: the exact layer, in a third form.
  auto full = store.Load("full", base + ",lowrank=energy:1");
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  ASSERT_NE((*full)->Find(Form::kLowRank), nullptr);
  EXPECT_EQ((*full)->lowrank_selection, "energy:1");
  EXPECT_EQ((*full)->lowrank_ranks, std::vector<int64_t>(6, 8));
  EXPECT_NEAR((*full)->lowrank_kept_energy, 1.0, 1e-12);
  EXPECT_EQ((*full)->Find(Form::kLowRank)->weights().form, Form::kLowRank);
  EXPECT_EQ((*full)->Find(Form::kLowRank)->weights().Parameters(), FormParameters(Form::kLowRank, w.config, 48));
  for (int k = 0; k < 3; ++k) {
    testing::OwnedSequence seq = testing::RandomSequence(rng, 48, 7, 7, false, k == 1, -1);
    const Sequence view = seq.View();
    ASSERT_TRUE(Cpu().Forward(*(*full)->Find(Form::kLowRank), std::span<const Sequence>(&view, 1)).ok());
    EXPECT_LT(testing::RelativeL2(seq.output.data(), ReferenceForward(w, view)), 1e-5);
  }

  // A budget: Σ r_i is the budget, filled by the largest singular values of all heads.
  for (const auto& [budget, ranks, kept] :
       {std::tuple{13, known.budget_13, known.kept_budget_13}, std::tuple{20, known.budget_20, known.kept_budget_20}}) {
    const std::string selection = "budget:" + std::to_string(budget);
    auto layer = store.Load("budget" + std::to_string(budget), base + ",lowrank=" + selection);
    ASSERT_TRUE(layer.ok()) << layer.status().ToString();
    EXPECT_EQ((*layer)->lowrank_selection, selection);
    EXPECT_EQ((*layer)->lowrank_ranks, ranks);
    EXPECT_NEAR((*layer)->lowrank_kept_energy, kept, 1e-6) << selection;
    EXPECT_EQ((*layer)->Find(Form::kLowRank)->weights().value_cols, budget);
  }

  // An energy level: each head keeps the fewest directions holding that share.
  auto energy = store.Load("energy", base + ",lowrank=energy:0.9");
  ASSERT_TRUE(energy.ok()) << energy.status().ToString();
  EXPECT_EQ((*energy)->lowrank_ranks, known.rank_90);
  EXPECT_NEAR((*energy)->lowrank_kept_energy, known.kept_energy_90, 1e-6);
  auto energy_99 = store.Load("energy99", base + ",lowrank=energy:0.99");
  ASSERT_TRUE(energy_99.ok()) << energy_99.status().ToString();
  EXPECT_EQ((*energy_99)->lowrank_ranks, known.rank_99);

  // A budget beyond Σ min(d_model, d_head) names the limit.
  ExpectError(store.Load("big", base + ",lowrank=budget:49").status(), StatusCode::kInvalidArgument,
              {"lowrank", "[1, 48]", "49"}, "budget 49");
  // The low-rank form's size is bounded like the others.
  LayerStore small(&Cpu(), {.max_form_bytes = FormParameters(Form::kFactored, w.config) * 4});
  ASSERT_TRUE(small.Load("fits", base + ",summed=false,lowrank=budget:4").ok());
  ExpectError(small.Load("too-big", base + ",summed=false,lowrank=energy:1").status(), StatusCode::kResourceExhausted,
              {"low-rank", "budget"}, "lowrank too big");
}

TEST(LowRank, RandomSourcesTakeRopeTheta) {
  auto s = LoadSource("random:d_model=32,heads=4,rope_theta=10000");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->weights.config.rope_theta, 10000.0);
  EXPECT_EQ(MustLoad("random:d_model=32,heads=4").config.rope_theta, 0.0);
  // The weights do not depend on rope_theta: only the positions do.
  EXPECT_EQ(s->weights.w_q, MustLoad("random:d_model=32,heads=4").w_q);
  LayerStore store(&Cpu());
  auto layer = store.Load("r", "random:d_model=32,heads=4,rope_theta=10000,lowrank=energy:1");
  ASSERT_TRUE(layer.ok()) << layer.status().ToString();
  std::mt19937_64 rng(testing::TestSeed() + 3);
  for (Form form : {Form::kFactored, Form::kSummed, Form::kLowRank}) {
    EXPECT_LT(WorstAgainstReference(*(*layer)->Find(form), s->weights, rng), 1e-5) << FormName(form);
  }
}

// ---- The grammar --------------------------------------------------------------------------------

TEST(SourceGrammar, GoodRandomSources) {
  auto a = ParseSource("random:d_model=768,heads=12");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->kind, SourceKind::kRandom);
  EXPECT_EQ(a->config.d_model, 768);
  EXPECT_EQ(a->config.heads, 12);
  EXPECT_EQ(a->config.kv_heads, 12);
  EXPECT_EQ(a->config.d_head, 64);
  EXPECT_TRUE(a->config.bias);
  EXPECT_EQ(a->seed, 1u);
  EXPECT_TRUE(a->hold_summed);

  auto b = ParseSource("random:d_model=64,heads=8,kv_heads=2,d_head=16,bias=false,seed=18446744073709551615,summed=false");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->config.kv_heads, 2);
  EXPECT_EQ(b->config.d_head, 16);
  EXPECT_FALSE(b->config.bias);
  EXPECT_EQ(b->seed, std::numeric_limits<uint64_t>::max());
  EXPECT_FALSE(b->hold_summed);

  auto c = ParseSource(" random: d_model = 64 , heads = 4 ");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->config.d_model, 64);
  EXPECT_TRUE(c->compute_spectrum);
  EXPECT_FALSE(c->lowrank.has_value());
  EXPECT_FALSE(c->rope_theta.has_value());
  EXPECT_EQ(c->config.rope_theta, 0.0);

  auto d = ParseSource("random:d_model=64,heads=4,rope_theta=500000,lowrank=energy:0.99");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->config.rope_theta, 500000.0);
  ASSERT_TRUE(d->lowrank.has_value());
  EXPECT_EQ(d->lowrank->selection.kind, RankSelection::Kind::kEnergy);
  EXPECT_EQ(d->lowrank->selection.energy, 0.99);
  EXPECT_EQ(d->lowrank->text, "energy:0.99");

  auto e = ParseSource("random:d_model=64,heads=4,lowrank= budget : 256 ,spectrum=true,rope_theta=1e4");
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->lowrank->selection.kind, RankSelection::Kind::kBudget);
  EXPECT_EQ(e->lowrank->selection.budget, 256);
  EXPECT_EQ(e->lowrank->text, "budget:256");
  EXPECT_EQ(e->config.rope_theta, 10000.0);
  EXPECT_FALSE(ParseSource("random:d_model=64,heads=4,spectrum=false")->compute_spectrum);
}

TEST(SourceGrammar, GoodSafetensorsSources) {
  auto a = ParseSource("safetensors:/models/gpt2/model.safetensors");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->kind, SourceKind::kSafetensors);
  EXPECT_EQ(a->path, "/models/gpt2/model.safetensors");
  EXPECT_EQ(a->arch, CheckpointArch::kAuto);
  EXPECT_FALSE(a->index.has_value());
  EXPECT_FALSE(a->prefix.has_value());
  EXPECT_EQ(a->heads, 0);
  EXPECT_TRUE(a->hold_summed);

  auto b = ParseSource("safetensors:m.safetensors,arch=gpt2,index=11,prefix=transformer.,heads=12,kv_heads=4,summed=false");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->path, "m.safetensors");
  EXPECT_EQ(b->arch, CheckpointArch::kGpt2);
  EXPECT_EQ(b->index, 11);
  EXPECT_EQ(b->prefix, "transformer.");
  EXPECT_EQ(b->heads, 12);
  EXPECT_EQ(b->kv_heads, 4);
  EXPECT_FALSE(b->hold_summed);

  auto c = ParseSource("safetensors:m.safetensors,arch=bert,prefix=");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->prefix, "");
  EXPECT_EQ(ParseSource("safetensors:a=b.safetensors,arch=torch-mha")->path, "a=b.safetensors");

  auto d = ParseSource("safetensors:m.safetensors,arch=llama,index=3,rope_theta=500000.5,lowrank=energy:0.999");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->arch, CheckpointArch::kLlama);
  EXPECT_EQ(d->index, 3);
  EXPECT_EQ(d->rope_theta, 500000.5);
  EXPECT_EQ(d->lowrank->text, "energy:0.999");
  EXPECT_EQ(ParseSource("safetensors:m.safetensors,rope_theta=0")->rope_theta, 0.0);
}

TEST(SourceGrammar, BadSourcesNameTheKey) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {"", {"random:", "safetensors:"}},
      {"random", {"kind 'random'"}},
      {"file:/x", {"kind 'file'"}},
      {"random:", {"d_model"}},
      {"random:heads=4", {"d_model"}},
      {"random:d_model=64", {"'heads'"}},
      {"random:d_model=64,heads=4,color=red", {"'color'", "unknown option"}},
      {"random:d_model=64,heads=4,heads=4", {"'heads'", "more than once"}},
      {"random:d_model=,heads=4", {"'d_model'", "no value"}},
      {"random:d_model,heads=4", {"'d_model'", "no value"}},
      {"random:d_model=abc,heads=4", {"'d_model'", "'abc'"}},
      {"random:d_model=64x,heads=4", {"'d_model'", "'64x'"}},
      {"random:d_model=-64,heads=4", {"'d_model'"}},
      {"random:d_model=99999999,heads=4", {"'d_model'", "65536"}},
      {"random:d_model=99999999999999999999999,heads=4", {"'d_model'"}},
      {"random:d_model=64,heads=0", {"'heads'"}},
      {"random:d_model=64,heads=4,kv_heads=3", {"kv_heads"}},
      {"random:d_model=64,heads=4,kv_heads=0", {"'kv_heads'"}},
      {"random:d_model=64,heads=4,d_head=0", {"'d_head'"}},
      {"random:d_model=10,heads=4", {"d_head"}},
      {"random:d_model=64,heads=4,seed=-1", {"'seed'"}},
      {"random:d_model=64,heads=4,seed=1.5", {"'seed'"}},
      {"random:d_model=64,heads=4,bias=yes", {"'bias'", "true or false"}},
      {"random:d_model=64,heads=4,summed=1", {"'summed'"}},
      {"random:d_model=64,heads=4,", {"empty option"}},
      {"random:d_model=64,heads=4,arch=gpt2", {"'arch'"}},
      {"safetensors:", {"path"}},
      {"safetensors:,heads=4", {"path"}},
      {"safetensors:m.safetensors,arch=mistral", {"'arch'", "'mistral'", "llama"}},
      {"random:d_model=64,heads=4,lowrank=0.99", {"'lowrank'", "energy:E", "budget:R", "'0.99'"}},
      {"random:d_model=64,heads=4,lowrank=energy:0", {"'lowrank'", "'energy:0'"}},
      {"random:d_model=64,heads=4,lowrank=energy:1.5", {"'lowrank'"}},
      {"random:d_model=64,heads=4,lowrank=energy:x", {"'lowrank'"}},
      {"random:d_model=64,heads=4,lowrank=budget:0", {"'lowrank'", "'budget:0'"}},
      {"random:d_model=64,heads=4,lowrank=budget:2.5", {"'lowrank'"}},
      {"random:d_model=64,heads=4,lowrank=rank:4", {"'lowrank'"}},
      {"random:d_model=64,heads=4,lowrank=energy:0.9,spectrum=false", {"'lowrank'", "spectrum=false"}},
      {"random:d_model=64,heads=4,spectrum=no", {"'spectrum'", "true or false"}},
      {"random:d_model=64,heads=4,rope_theta=-1", {"'rope_theta'", "'-1'"}},
      {"random:d_model=64,heads=4,rope_theta=inf", {"'rope_theta'"}},
      {"random:d_model=64,heads=4,rope_theta=1e13", {"'rope_theta'"}},
      {"random:d_model=64,heads=4,rope_theta=abc", {"'rope_theta'"}},
      {"random:d_model=12,heads=4,rope_theta=10000", {"even d_head"}},
      {"safetensors:m.safetensors,lowrank=budget:", {"'lowrank'"}},
      {"safetensors:m.safetensors,rope_theta=", {"'rope_theta'", "no value"}},
      {"safetensors:m.safetensors,index=x", {"'index'"}},
      {"safetensors:m.safetensors,index=-1", {"'index'"}},
      {"safetensors:m.safetensors,heads=0", {"'heads'"}},
      {"safetensors:m.safetensors,heads", {"'heads'", "no value"}},
      {"safetensors:m.safetensors,kv_heads=z", {"'kv_heads'"}},
      {"safetensors:m.safetensors,summed=maybe", {"'summed'"}},
      {"safetensors:m.safetensors,d_model=64", {"'d_model'", "unknown option"}},
      {"safetensors:m.safetensors,arch=torch-mha,index=1", {"'index'", "prefix="}},
      {"safetensors:m.safetensors,=4", {"no key"}},
  };
  for (const auto& [source, words] : bad) {
    auto spec = ParseSource(source);
    ExpectError(spec.status(), StatusCode::kInvalidArgument, words, "'" + source + "'");
    if (!spec.ok()) {
      EXPECT_NE(spec.status().message().find("source '" + source + "'"), std::string::npos) << spec.status().message();
    }
  }
}

// The registry of checkpoint layouts (server/store/arch) holds exactly the known ones, in the
// order messages list them, and arch= names them or is refused with the list.
TEST(SourceGrammar, ArchRegistryListsTheKnownLayouts) {
  std::vector<std::string> names;
  for (const ArchLayout* layout : ArchLayouts()) names.emplace_back(layout->name);
  EXPECT_EQ(names, (std::vector<std::string>{"torch-mha", "gpt2", "bert", "llama"}));
  EXPECT_EQ(ArchLayoutChoices(), "torch-mha, gpt2, bert or llama");
  for (const CheckpointArch arch :
       {CheckpointArch::kTorchMha, CheckpointArch::kGpt2, CheckpointArch::kBert, CheckpointArch::kLlama}) {
    ASSERT_NE(FindArchLayout(arch.name()), nullptr) << arch;
    auto spec = ParseSource("safetensors:m.safetensors,arch=" + std::string(arch.name()));
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->arch, arch);
  }
  EXPECT_EQ(FindArchLayout("auto"), nullptr);
  for (const char* unknown : {"gpt3", "auto", "LLAMA", ""}) {
    const std::string source = std::string("safetensors:m.safetensors,arch=") + unknown;
    auto spec = ParseSource(source);
    ASSERT_FALSE(spec.ok()) << source;
    EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument);
    if (*unknown == '\0') continue;  // an empty value is "no value", said before the name is looked up
    EXPECT_EQ(spec.status().message(), "source '" + source + "': option 'arch': expected torch-mha, gpt2, bert or llama, got '" +
                                           unknown + "'");
  }
}

// ---- Random sources -----------------------------------------------------------------------------

TEST(Sources, RandomIsSeededAndDeterministic) {
  const LayerWeights a = MustLoad("random:d_model=32,heads=4,seed=5");
  ExpectSameWeights(a, MustLoad("random:d_model=32,heads=4,seed=5"), "same seed");
  EXPECT_NE(a.w_q, MustLoad("random:d_model=32,heads=4,seed=6").w_q);
  EXPECT_EQ(a.config.d_head, 8);
  const LayerWeights nb = MustLoad("random:d_model=32,heads=4,bias=false");
  EXPECT_TRUE(nb.b_q.empty() && nb.b_o.empty());
  auto s = LoadSource("random:d_model=32,heads=4,kv_heads=2,d_head=12,summed=false");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE(s->hold_summed);
  EXPECT_EQ(s->weights.w_k.size(), 32u * 2 * 12);
}

TEST(Sources, FormSizesAreBoundedBeforeAllocating) {
  for (const char* source : {"random:d_model=32,heads=4", "random:d_model=48,heads=6,kv_heads=2,d_head=5",
                             "random:d_model=16,heads=2,bias=false"}) {
    const LayerWeights w = MustLoad(source);
    EXPECT_EQ(FormParameters(Form::kFactored, w.config), MaterializeFactored(w).Parameters()) << source;
    EXPECT_EQ(FormParameters(Form::kSummed, w.config), MaterializeSummed(w).Parameters()) << source;
  }
  auto spec = ParseSource("random:d_model=64,heads=16");
  ASSERT_TRUE(spec.ok());
  const int64_t factored = FormParameters(Form::kFactored, spec->config) * 4, summed = FormParameters(Form::kSummed, spec->config) * 4;
  ASSERT_LT(factored, summed);
  ExpectError(LoadSource(*spec, factored).status(), StatusCode::kResourceExhausted, {"summed", "summed=false"},
              "summed too large");
  spec->hold_summed = false;
  EXPECT_TRUE(LoadSource(*spec, factored).ok());
  ExpectError(LoadSource(*spec, factored - 1).status(), StatusCode::kResourceExhausted, {"limit"}, "too large");
  // The largest layer the grammar allows is refused, not allocated.
  ExpectError(LoadSource("random:d_model=65536,heads=1024").status(), StatusCode::kResourceExhausted, {"bytes"},
              "huge layer");
}

// ---- Files beneath a model dir --------------------------------------------------------------------

// What an API load may open beneath a model dir: a regular file below it, nothing else (not a
// FIFO, a device, a directory, a symlink, a way up, an absolute path), each refused with the
// answer a missing file gets but for the name, so the answer says nothing of what is there.
TEST(CheckpointFile, BeneathADirOnlyARegularFileBelowItOpens) {
  TempDir tmp;
  const std::string models = tmp.File("models");
  std::filesystem::create_directories(models + "/sub");
  std::ofstream(models + "/sub/ok.safetensors") << "bytes";
  std::ofstream(tmp.File("outside.safetensors")) << "bytes";
  ASSERT_EQ(mkfifo((models + "/fifo.safetensors").c_str(), 0600), 0);
  std::filesystem::create_symlink("/dev/zero", models + "/zero.safetensors");
  std::filesystem::create_symlink(tmp.File("outside.safetensors"), models + "/out.safetensors");
  std::filesystem::create_symlink("sub/ok.safetensors", models + "/in.safetensors");

  auto ok = OpenCheckpointFile(models, "sub/ok.safetensors");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_GE(ok->get(), 0);
  const std::string missing = OpenCheckpointFile(models, "missing.safetensors").status().message();
  for (const std::string& path : std::vector<std::string>{
           "fifo.safetensors", "zero.safetensors", "out.safetensors", "in.safetensors", "sub", "../outside.safetensors",
           "sub/../../outside.safetensors", tmp.File("outside.safetensors"), ""}) {
    const auto refused = OpenCheckpointFile(models, path);
    ASSERT_FALSE(refused.ok()) << "'" << path << "' opened";
    EXPECT_EQ(refused.status().code(), StatusCode::kNotFound) << path;
    std::string normalized = refused.status().message();
    normalized.replace(normalized.find("'" + path + "'"), path.size() + 2, "'missing.safetensors'");
    EXPECT_EQ(normalized, missing) << path;
  }
}

// ---- LayerStore ---------------------------------------------------------------------------------

TEST(LayerStore, LoadListGetUnload) {
  LayerStore store(&Cpu());
  EXPECT_TRUE(store.List().empty());
  EXPECT_EQ(store.Get("a"), nullptr);
  auto b = store.Load("b", "random:d_model=32,heads=4,summed=false");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  auto a = store.Load("a", "random:d_model=32,heads=4,seed=3");
  ASSERT_TRUE(a.ok()) << a.status().ToString();

  EXPECT_EQ((*a)->name, "a");
  EXPECT_EQ((*a)->source, "random:d_model=32,heads=4,seed=3");
  EXPECT_EQ((*a)->device, "cpu");
  EXPECT_EQ((*a)->config.d_head, 8);
  EXPECT_NE((*a)->Find(Form::kFactored), nullptr);
  EXPECT_NE((*a)->Find(Form::kSummed), nullptr);
  EXPECT_EQ((*a)->Find(Form::kLowRank), nullptr);
  EXPECT_EQ((*a)->Find(Form::kSummed)->weights().form, Form::kSummed);
  EXPECT_NE((*b)->Find(Form::kFactored), nullptr);
  EXPECT_EQ((*b)->Find(Form::kSummed), nullptr);

  const auto list = store.List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0]->name, "a");
  EXPECT_EQ(list[1]->name, "b");
  EXPECT_EQ(store.Get("a"), *a);

  EXPECT_TRUE(store.Unload("a").ok());
  EXPECT_EQ(store.Get("a"), nullptr);
  ExpectError(store.Unload("a"), StatusCode::kNotFound, {"'a'"}, "second unload");
  EXPECT_EQ(store.List().size(), 1u);
}

TEST(LayerStore, ReplaceKeepsTheOldLayerAliveForItsHolders) {
  LayerStore store(&Cpu());
  ASSERT_TRUE(store.Load("x", "random:d_model=32,heads=4,seed=1").ok());
  const std::shared_ptr<const Layer> old = store.Get("x");
  ASSERT_NE(old, nullptr);

  std::mt19937_64 rng(testing::TestSeed());
  testing::OwnedSequence before = testing::RandomSequence(rng, 32, 6, 6, false, false, -1);
  const Sequence before_view = before.View();
  ASSERT_TRUE(Cpu().Forward(*old->Find(Form::kFactored), std::span<const Sequence>(&before_view, 1)).ok());

  auto replaced = store.Load("x", "random:d_model=32,heads=4,seed=2");
  ASSERT_TRUE(replaced.ok());
  EXPECT_NE(store.Get("x"), old);
  EXPECT_EQ(store.Get("x")->source, "random:d_model=32,heads=4,seed=2");
  EXPECT_EQ(store.List().size(), 1u);
  ASSERT_TRUE(store.Unload("x").ok());

  // The old layer, replaced and then unloaded, still runs and gives the same answer.
  EXPECT_EQ(old->source, "random:d_model=32,heads=4,seed=1");
  testing::OwnedSequence after = before;
  after.output.assign(after.output.size(), std::nanf(""));
  const Sequence after_view = after.View();
  ASSERT_TRUE(Cpu().Forward(*old->Find(Form::kFactored), std::span<const Sequence>(&after_view, 1)).ok());
  EXPECT_EQ(after.output, before.output);
  const double err = testing::RelativeL2(after.output.data(),
                                         ReferenceForward(MustLoad("random:d_model=32,heads=4,seed=1"), after_view));
  EXPECT_LT(err, 1e-5);
}

TEST(LayerStore, FailedLoadLeavesTheOldLayer) {
  LayerStore store(&Cpu());
  ASSERT_TRUE(store.Load("x", "random:d_model=32,heads=4").ok());
  const auto old = store.Get("x");
  auto bad = store.Load("x", "random:d_model=32,heads=5");
  ExpectError(bad.status(), StatusCode::kInvalidArgument, {"layer 'x'", "random:d_model=32,heads=5"}, "bad load");
  EXPECT_EQ(store.Get("x"), old);
  auto missing = store.Load("y", "safetensors:/nonexistent/dir/m.safetensors,heads=4");
  ExpectError(missing.status(), StatusCode::kNotFound, {"layer 'y'", "/nonexistent/dir/m.safetensors"}, "missing");
  EXPECT_EQ(store.Get("y"), nullptr);
}

TEST(LayerStore, LayerNames) {
  LayerStore store(&Cpu());
  const std::string src = "random:d_model=16,heads=2";
  for (const std::string& good : {std::string("a"), std::string("gpt2.h-0_attn"), std::string(128, 'z')}) {
    EXPECT_TRUE(ValidateLayerName(good).ok()) << good;
  }
  EXPECT_TRUE(store.Load(std::string(128, 'z'), src).ok());
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "''"}, {std::string(129, 'z'), "129"}, {"a b", "character 1"}, {"a/b", "character 1"},
      {"l\xc3\xa4yer", "character 1"}, {std::string("a\0b", 3), "character 1"}};
  for (const auto& [name, word] : bad) {
    ExpectError(store.Load(name, src).status(), StatusCode::kInvalidArgument, {"layer name", word}, "name");
  }
  EXPECT_EQ(store.List().size(), 1u);
}

// --max-layers and --max-layer-mb: a layer past either cap is refused, naming the flag; a load
// that replaces a held layer is no new layer, and the copy it replaces does not count against
// the bytes (it is freed once its holders let go).
TEST(LayerStore, CapsRefuseANewLayerButNotAReplacement) {
  const std::string source = "random:d_model=32,heads=4,seed=";
  LayerStore probe(&Cpu());
  auto measured = probe.Load("p", source + "1");
  ASSERT_TRUE(measured.ok()) << measured.status().ToString();
  int64_t one = 0;  // what one such layer holds: every form in every math
  for (const Variant& v : (*measured)->Variants()) one += (*measured)->HostBytesOf(v);
  ASSERT_GT(one, 0);

  LayerStore bytes(&Cpu(), {.max_total_bytes = one * 3 / 2});
  ASSERT_TRUE(bytes.Load("a", source + "1").ok());
  ExpectError(bytes.Load("b", source + "2").status(), StatusCode::kResourceExhausted, {"layer 'b'", "--max-layer-mb"},
              "a second layer past the bytes");
  auto replaced = bytes.Load("a", source + "3");
  ASSERT_TRUE(replaced.ok()) << replaced.status().ToString();
  EXPECT_EQ(bytes.Get("a")->source, source + "3");

  LayerStore count(&Cpu(), {.max_layers = 1});
  ASSERT_TRUE(count.Load("a", source + "1").ok());
  ASSERT_TRUE(count.Load("a", source + "2").ok()) << "a replacement at the cap";
  ExpectError(count.Load("b", source + "3").status(), StatusCode::kResourceExhausted, {"--max-layers"},
              "a second layer past the count");
  EXPECT_EQ(count.List().size(), 1u);
}

// Readers take and use layers while writers replace and unload them: no reader sees a torn or
// freed layer. (The TSan build runs this too.)
TEST(LayerStore, ConcurrentGetAndLoad) {
  LayerStore store(&Cpu());
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(store.Load("l" + std::to_string(k), "random:d_model=32,heads=4,seed=" + std::to_string(k)).ok());
  }
  std::atomic<bool> stop{false};
  std::atomic<int> forwards{0}, loads{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(testing::TestSeed() + t);
      // At least a few rounds each, however the scheduler orders the threads on a busy machine.
      for (int round = 0; !stop.load() || round < 5; ++round) {
        const auto layer = store.Get("l" + std::to_string(rng() % 3));
        EXPECT_NE(layer, nullptr);
        if (!layer) continue;
        const Form form = rng() % 2 ? Form::kFactored : Form::kSummed;
        testing::OwnedSequence seq = testing::RandomSequence(rng, 32, 4, 4, false, true, -1);
        const Sequence view = seq.View();
        EXPECT_TRUE(Cpu().Forward(*layer->Find(form), std::span<const Sequence>(&view, 1)).ok());
        for (float v : seq.output) EXPECT_TRUE(std::isfinite(v));
        const auto list = store.List();
        for (size_t i = 1; i < list.size(); ++i) EXPECT_LT(list[i - 1]->name, list[i]->name);
        ++forwards;
      }
    });
  }
  std::vector<std::thread> writers;
  for (int t = 0; t < 2; ++t) {
    writers.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        const std::string seed = std::to_string(100 * t + i);
        EXPECT_TRUE(store.Load("l" + std::to_string(i % 3), "random:d_model=32,heads=4,seed=" + seed).ok());
        const std::string tmp = "tmp" + std::to_string(t);
        EXPECT_TRUE(store.Load(tmp, "random:d_model=16,heads=2,summed=false").ok());
        EXPECT_TRUE(store.Unload(tmp).ok());
        ++loads;
      }
    });
  }
  for (auto& w : writers) w.join();
  stop = true;
  for (auto& r : threads) r.join();
  EXPECT_EQ(loads.load(), 50);
  EXPECT_GE(forwards.load(), 10);
  EXPECT_EQ(store.List().size(), 3u);
}

}  // namespace
}  // namespace attnserve
