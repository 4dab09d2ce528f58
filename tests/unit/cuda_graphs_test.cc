// CUDA graphs of small batches (CudaBackendOptions::graph_rows) on the emulated device: a
// replay answers exactly as the launches it stands for, reading each batch's own inputs; what
// names a graph (the signature), the bound on a lane's graphs, a capture that fails; and the
// emulation's stream capture itself (tests/cuda_emulation/README.md has its rules).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/lane.h"
#include "server/core/forms.h"
#include "server/core/reference.h"
#include "server/core/spectrum.h"
#include "tests/unit/cuda_test_support.h"
#include "tests/unit/test_support.h"

namespace attnserve {
namespace {

using testing::OwnedSequence;
using testing::RandomSequence;
using testing::RelativeL2;

class CudaGraphsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cuda_emulation::Reset();
    cudaGetLastError();
  }
  void TearDown() override { cuda_emulation::Reset(); }
  std::mt19937_64 rng_{testing::TestSeed()};
};

constexpr int64_t kD = 32;
constexpr int kGraphRows = 64;

struct Shape {
  int64_t n = 1, m = 0;  // m: a cross-attention context's rows; 0: self-attention
  bool causal = false;
  int64_t key_length = -1, position_offset = 0;
};

// Sequences of these shapes with fresh random inputs (outputs NaN until written).
std::vector<OwnedSequence> Fresh(std::mt19937_64& rng, const std::vector<Shape>& shapes) {
  std::vector<OwnedSequence> seqs;
  for (const Shape& s : shapes) {
    seqs.push_back(RandomSequence(rng, kD, s.n, s.m > 0 ? s.m : s.n, s.m > 0, s.causal, s.key_length));
    seqs.back().position_offset = s.position_offset;
  }
  return seqs;
}

// The batch's outputs, one after another, from a copy of `seqs` (so two backends answer the same
// inputs each into its own outputs).
std::vector<float> Forward(Backend& backend, const ResidentForm& form, std::vector<OwnedSequence> seqs) {
  std::vector<Sequence> batch;
  for (auto& s : seqs) batch.push_back(s.View());
  const Status st = backend.Forward(form, batch);
  EXPECT_TRUE(st.ok()) << st.ToString();
  std::vector<float> out;
  for (const auto& s : seqs) out.insert(out.end(), s.output.begin(), s.output.end());
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::unique_ptr<Backend> Make(const CudaBackendOptions& options) {
  auto made = MakeCudaBackend(options);
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  return made.ok() ? std::move(made).value() : nullptr;
}

LayerWeights RopeLayer(std::mt19937_64& rng, double rope_theta = 10000.0) {
  return RandomLayerWeights(
      *CompleteConfig({.d_model = kD, .heads = 4, .kv_heads = 2, .bias = true, .rope_theta = rope_theta}), rng());
}

// Self-attention causal and not, with positions; cross-attention with padded keys; two
// sequences of one shape (the GEMM path groups them): 17 query rows and 9 context rows.
const std::vector<Shape> kMixed = {{.n = 5, .causal = true, .position_offset = 7},
                                   {.n = 3, .m = 9, .key_length = 6},
                                   {.n = 4, .position_offset = 0},
                                   {.n = 5, .causal = true, .position_offset = 7}};

// Every form, on the fused kernel and on the GEMM path, in FP32 and BF16: each round's new inputs give, with
// graphs, the bits they give without, and differ from the round before's (a graph replaying
// the inputs it was captured with would answer the first round again). The first batch is
// captured and launched as one graph; the later ones launch it and nothing else.
TEST_F(CudaGraphsTest, ReplaysAnswerAsTheLaunchesForEveryFormAndPathReadingEachBatchsInputs) {
  const LayerWeights w = RopeLayer(rng_);
  // Low rank at ragged ranks (the GEMM path's) and at one rank (the fused kernel takes it).
  auto ragged = MaterializeLowRank(w, std::vector<int64_t>{2, 5, 8, 3});
  auto one_rank = MaterializeLowRank(w, std::vector<int64_t>(4, 6));
  ASSERT_TRUE(ragged.ok() && one_rank.ok());
  const std::vector<std::pair<const char*, FormWeights>> forms = {{"factored", MaterializeFactored(w)},
                                                                  {"summed", MaterializeSummed(w)},
                                                                  {"low-rank, ragged", *ragged},
                                                                  {"low-rank, one rank", *one_rank}};
  // FP32, and BF16 weights (the inputs' 16-bit conversion is captured too).
  for (const auto& [math, gemm] : {std::pair{Math::kFp32, false}, std::pair{Math::kFp32, true},
                                   std::pair{Math::kBf16, false}, std::pair{Math::kBf16, true}}) {
    auto off = Make({.math = math, .gemm_attention = gemm, .guard_zones = true});
    auto on = Make({.math = math, .gemm_attention = gemm, .graph_rows = kGraphRows, .guard_zones = true});
    ASSERT_TRUE(off && on);
    for (const auto& [name, form] : forms) {
      SCOPED_TRACE(std::string(name) + (gemm ? ", GEMM attention, " : ", fused, ") + std::string(MathName(math)));
      auto shared = std::make_shared<const FormWeights>(form);
      auto resident_off = off->Upload(shared), resident_on = on->Upload(shared);
      ASSERT_TRUE(resident_off.ok() && resident_on.ok());
      std::vector<float> before;
      for (int round = 0; round < 3; ++round) {
        SCOPED_TRACE("round " + std::to_string(round));
        const std::vector<OwnedSequence> seqs = Fresh(rng_, kMixed);
        const std::vector<float> expected = Forward(*off, **resident_off, seqs);
        cuda_emulation::ResetCounters();
        const std::vector<float> got = Forward(*on, **resident_on, seqs);
        const cuda_emulation::Counters c = cuda_emulation::ReadCounters();
        EXPECT_TRUE(SameBits(got, expected));
        EXPECT_FALSE(SameBits(got, before)) << "new inputs, new answers";
        before = got;
        for (const float v : got) ASSERT_TRUE(std::isfinite(v));
        EXPECT_EQ(c.graph_captures, round == 0 ? 1 : 0);
        EXPECT_EQ(c.graph_launches, 1);
        if (round > 0) {
          EXPECT_EQ(c.kernel_launches, 0) << "a replay launches its graph alone";
          EXPECT_EQ(c.gemm_calls, 0);
        }
      }
    }
  }
}

// Per batch on a replay: one graph launch, no kernel launch and no GEMM call, where the same
// batch without graphs makes its pinned counts (cuda_emulated_test.cc, LaunchesPerBatchArePinned).
TEST_F(CudaGraphsTest, AReplayIsOneGraphLaunch) {
  auto on = Make({.gemm_attention = true, .graph_rows = kGraphRows});
  ASSERT_NE(on, nullptr);
  const LayerWeights w = RopeLayer(rng_);
  auto resident = on->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  const std::vector<Shape> shapes = {{.n = 3, .causal = true, .position_offset = 4}, {.n = 2}, {.n = 3}};
  for (int round = 0; round < 2; ++round) {
    std::vector<OwnedSequence> seqs = Fresh(rng_, shapes);
    std::vector<Sequence> batch;
    for (auto& s : seqs) batch.push_back(s.View());
    cuda_emulation::ResetCounters();
    ASSERT_TRUE(on->Forward(**resident, batch).ok());
    const cuda_emulation::Counters c = cuda_emulation::ReadCounters();
    for (size_t r = 0; r < seqs.size(); ++r) {
      EXPECT_LT(RelativeL2(seqs[r].output.data(), ReferenceForward(w, batch[r])), 1e-5) << "sequence " << r;
    }
    EXPECT_EQ(c.graph_launches, 1);
    EXPECT_EQ(c.graph_captures, round == 0 ? 1 : 0);
    EXPECT_EQ(c.kernel_launches > 0, round == 0) << "captured launches are counted once, when captured";
    EXPECT_EQ(c.gemm_calls > 0, round == 0);
    EXPECT_EQ(c.pageable_async_copies, 0);
  }
}

// What names a graph: each change below is a launch's argument, and captures anew; the same
// shapes with new values, or a position offset without RoPE, replay. A batch past graph_rows
// runs its launches, with no graph.
TEST_F(CudaGraphsTest, TheSignatureNamesEverythingThatChangesALaunch) {
  auto on = Make({.graph_rows = kGraphRows});
  ASSERT_NE(on, nullptr);
  const LayerWeights w = RopeLayer(rng_), plain = RopeLayer(rng_, 0.0);
  auto shared = std::make_shared<const FormWeights>(MaterializeFactored(w));
  auto rope = on->Upload(shared), again = on->Upload(shared);
  auto no_rope = on->Upload(std::make_shared<const FormWeights>(MaterializeFactored(plain)));
  ASSERT_TRUE(rope.ok() && again.ok() && no_rope.ok());
  auto captures = [&](const ResidentForm& form, const std::vector<Shape>& shapes) {
    cuda_emulation::ResetCounters();
    Forward(*on, form, Fresh(rng_, shapes));
    const cuda_emulation::Counters c = cuda_emulation::ReadCounters();
    EXPECT_LE(c.graph_launches, 1);
    return c.graph_launches == 0 ? -1 : c.graph_captures;  // -1: no graph at all
  };
  // The workspace at its largest first: every batch below fits in it, so none drops the graphs.
  Forward(*on, **rope, Fresh(rng_, {{.n = 2 * kGraphRows, .causal = true}, {.n = 8, .m = 2 * kGraphRows}}));
  const std::vector<Shape> base = {{.n = 4, .causal = true, .position_offset = 3}, {.n = 2, .m = 5, .key_length = 4}};
  EXPECT_EQ(captures(**rope, base), 1);
  auto changed = [&](auto change) {
    std::vector<Shape> s = base;
    change(s);
    return s;
  };
  const std::vector<std::pair<const char*, std::vector<Shape>>> changes = {
      {"queries", changed([](auto& s) { s[0].n = 5; })},
      {"context rows", changed([](auto& s) { s[1].m = 6; })},
      {"visible keys", changed([](auto& s) { s[1].key_length = 3; })},
      {"the mask", changed([](auto& s) { s[0].causal = false; })},
      {"RoPE positions", changed([](auto& s) { s[0].position_offset = 9; })},
      {"the order", changed([](auto& s) { std::swap(s[0], s[1]); })},
      {"the sequences", changed([](auto& s) { s.pop_back(); })}};
  for (const auto& [what, shapes] : changes) {
    // The base's graph is kept (a replay: the same shapes, new values), so a change the
    // signature missed would replay it too.
    EXPECT_EQ(captures(**rope, base), 0) << "before " << what;
    EXPECT_EQ(captures(**rope, shapes), 1) << what;
  }
  EXPECT_EQ(captures(**again, base), 1) << "another form (the same weights, uploaded again)";
  EXPECT_EQ(captures(**no_rope, base), 1);
  EXPECT_EQ(captures(**no_rope, changed([](auto& s) { s[0].position_offset = 11; })), 0)
      << "without RoPE the positions change no launch";
  EXPECT_EQ(captures(**rope, {{.n = kGraphRows / 2}, {.n = kGraphRows / 2 + 1}}), -1) << "past graph_rows";
  EXPECT_EQ(captures(**rope, {{.n = kGraphRows / 2}, {.n = kGraphRows / 2}}), 1) << "at graph_rows";
  auto off = Make({});
  cuda_emulation::ResetCounters();
  auto resident_off = off->Upload(shared);
  ASSERT_TRUE(resident_off.ok());
  Forward(*off, **resident_off, Fresh(rng_, base));
  EXPECT_EQ(cuda_emulation::ReadCounters().graph_launches, 0) << "graphs are off by default";
}

// A lane keeps kGraphsPerLane graphs, dropping the least recently used; a workspace allocated
// anew drops them all (their pointers lay in the old one); the backend's end frees them.
TEST_F(CudaGraphsTest, ALanesGraphsAreBoundedDroppedWithTheirWorkspaceAndFreed) {
  const int64_t baseline = cuda_emulation::LiveGraphExecs();
  {
    auto on = Make({.graph_rows = kGraphRows});
    ASSERT_NE(on, nullptr);
    auto resident = on->Upload(std::make_shared<const FormWeights>(MaterializeFactored(RopeLayer(rng_))));
    ASSERT_TRUE(resident.ok());
    auto run = [&](int64_t n) {
      cuda_emulation::ResetCounters();
      Forward(*on, **resident, Fresh(rng_, {{.n = n}}));
      return cuda_emulation::ReadCounters().graph_captures;
    };
    // Largest first: one workspace holds them all.
    const int64_t shapes = static_cast<int64_t>(cuda::kGraphsPerLane) + 3;
    for (int64_t n = shapes; n >= 1; --n) EXPECT_EQ(run(n), 1) << "n " << n;
    EXPECT_EQ(cuda_emulation::LiveGraphExecs() - baseline, static_cast<int64_t>(cuda::kGraphsPerLane));
    EXPECT_EQ(run(1), 0) << "the most recent";
    EXPECT_EQ(run(cuda::kGraphsPerLane), 0) << "the oldest kept";
    EXPECT_EQ(run(shapes), 1) << "dropped: the least recently used";
    Forward(*on, **resident, Fresh(rng_, {{.n = 4 * kGraphRows}}));  // a larger workspace, no graph
    EXPECT_EQ(run(1), 1) << "captured again in the new workspace";
    EXPECT_EQ(cuda_emulation::LiveGraphExecs() - baseline, 1);
  }
  EXPECT_EQ(cuda_emulation::LiveGraphExecs(), baseline) << "freed with the lanes";
}

// A capture that fails (its instantiation refused; an operation that invalidates it) does not
// fail the batch: it runs again without a graph, with the answers of a backend without graphs,
// and the next batch of its shape captures.
TEST_F(CudaGraphsTest, AFailedCaptureRunsTheBatchWithoutAGraph) {
  auto off = Make({.gemm_attention = true});
  auto on = Make({.gemm_attention = true, .graph_rows = kGraphRows});
  ASSERT_TRUE(off && on);
  auto shared = std::make_shared<const FormWeights>(MaterializeSummed(RopeLayer(rng_)));
  auto resident_off = off->Upload(shared), resident_on = on->Upload(shared);
  ASSERT_TRUE(resident_off.ok() && resident_on.ok());
  for (const cuda_emulation::Fault fault :
       {cuda_emulation::Fault::kGraphInstantiate, cuda_emulation::Fault::kCaptureInvalidated}) {
    const std::vector<Shape> shapes = {{.n = fault == cuda_emulation::Fault::kGraphInstantiate ? 3 : 6}, kMixed[1]};
    cuda_emulation::InjectFault(fault);
    std::vector<OwnedSequence> seqs = Fresh(rng_, shapes);
    cuda_emulation::ResetCounters();
    EXPECT_TRUE(SameBits(Forward(*on, **resident_on, seqs), Forward(*off, **resident_off, seqs)));
    const cuda_emulation::Counters failed = cuda_emulation::ReadCounters();
    EXPECT_EQ(failed.graph_launches, 0);
    EXPECT_EQ(failed.graph_instantiations, 0);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "no error left behind";
    for (int round = 0; round < 2; ++round) {
      seqs = Fresh(rng_, shapes);
      cuda_emulation::ResetCounters();
      const std::vector<float> got = Forward(*on, **resident_on, seqs);
      EXPECT_EQ(cuda_emulation::ReadCounters().graph_captures, round == 0 ? 1 : 0) << "round " << round;
      EXPECT_EQ(cuda_emulation::ReadCounters().graph_launches, 1);
      EXPECT_TRUE(SameBits(got, Forward(*off, **resident_off, seqs)));
    }
  }
}

// A lane whose captures keep failing stops capturing (kGraphFailuresPerLane): its batches run
// as without graphs, with no capture before each.
TEST_F(CudaGraphsTest, ALaneWhoseCapturesKeepFailingStopsCapturing) {
  auto on = Make({.graph_rows = kGraphRows});
  ASSERT_NE(on, nullptr);
  const LayerWeights w = RopeLayer(rng_);
  auto resident = on->Upload(std::make_shared<const FormWeights>(MaterializeFactored(w)));
  ASSERT_TRUE(resident.ok());
  cuda_emulation::InjectFault(cuda_emulation::Fault::kGraphInstantiate, static_cast<int>(cuda::kGraphFailuresPerLane));
  for (int64_t round = 0; round <= cuda::kGraphFailuresPerLane; ++round) {
    std::vector<OwnedSequence> seqs = Fresh(rng_, kMixed);
    std::vector<Sequence> batch;
    for (auto& s : seqs) batch.push_back(s.View());
    cuda_emulation::ResetCounters();
    ASSERT_TRUE(on->Forward(**resident, batch).ok());
    const cuda_emulation::Counters c = cuda_emulation::ReadCounters();
    EXPECT_EQ(c.graph_captures, round < cuda::kGraphFailuresPerLane ? 1 : 0) << "round " << round;
    EXPECT_EQ(c.graph_launches, 0);
    for (size_t r = 0; r < seqs.size(); ++r) {
      EXPECT_LT(RelativeL2(seqs[r].output.data(), ReferenceForward(w, batch[r])), 1e-5) << "sequence " << r;
    }
  }
}

// --- The emulation's stream capture ----------------------------------------------------------

// Work on a capturing stream is recorded, not run; each launch of the graph runs it, reading
// pinned memory as it is then. Synchronising the capturing stream is refused and invalidates
// the capture, which then makes no graph; so does an allocation on the capturing thread, except
// in relaxed mode. The legacy default stream cannot be captured.
TEST_F(CudaGraphsTest, StreamCaptureRecordsAndGraphsReplay) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  float *device = nullptr, *in = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 4 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&in, 4 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&out, 4 * sizeof(float)), cudaSuccess);
  cudaStreamCaptureStatus status;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaStreamIsCapturing(stream, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaErrorIllegalState);
  cudaGetLastError();
  ASSERT_EQ(cudaMemcpyAsync(device, in, 4 * sizeof(float), cudaMemcpyHostToDevice, stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(out, device, 4 * sizeof(float), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaStreamIsCapturing(stream, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  for (const float value : {1.5f, -2.25f}) {
    for (int i = 0; i < 4; ++i) in[i] = value * static_cast<float>(i + 1);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], value * static_cast<float>(i + 1)) << "read when it runs";
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);

  // Refused during a capture, each invalidating it.
  auto refused = [&](auto call, cudaError_t expected) {
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_EQ(call(), expected);
    EXPECT_EQ(cudaStreamIsCapturing(stream, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusInvalidated);
    EXPECT_EQ(cudaMemsetAsync(device, 0, 4, stream), cudaErrorStreamCaptureInvalidated);
    cudaGraph_t none = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(stream, &none), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(none, nullptr);
    cudaGetLastError();
  };
  refused([&] { return cudaStreamSynchronize(stream); }, cudaErrorStreamCaptureUnsupported);
  void* more = nullptr;
  refused([&] { return cudaMalloc(&more, 16); }, cudaErrorStreamCaptureUnsupported);
  refused([&] { return cudaMemcpy(out, device, 4, cudaMemcpyDeviceToHost); }, cudaErrorStreamCaptureUnsupported);
  std::vector<float> pageable(4);
  refused([&] { return cudaMemcpyAsync(device, pageable.data(), 4, cudaMemcpyHostToDevice, stream); },
          cudaErrorStreamCaptureUnsupported);
  // Relaxed: the thread may allocate.
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&more, 16), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaFree(more), cudaSuccess);
  EXPECT_EQ(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeThreadLocal), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaErrorIllegalState) << "not capturing";
  cudaGetLastError();
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(in), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(out), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace attnserve
