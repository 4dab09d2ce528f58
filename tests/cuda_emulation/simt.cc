// The fibers behind the emulated kernels: every thread of a block gets a stack; a scheduler on
// the launching thread runs each fiber until it reaches a barrier (or ends), and releases a
// barrier once every thread it names has arrived.
#include "simt.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_fp16.h"
#include "server/core/splitmix64.h"
#include "state.h"

#if defined(ATTNSERVE_ASAN)
#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMULATION_ASAN 1
#endif

#if defined(ATTNSERVE_TSAN)
#include <sanitizer/tsan_interface.h>
#define CUDA_EMULATION_TSAN 1
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace cuda_emulation {
namespace {

constexpr size_t kStackBytes = 64 * 1024;
constexpr int kWarp = 32;
constexpr int kMmaRegs = 6;  // an mma.m16n8k16 lane's operands: 4 registers of A, 2 of B
constexpr unsigned kMaxThreads = 1024;

// A saved execution context. On x86-64 a stack pointer and a 12-instruction switch (callee-
// saved registers only, ~20 ns); elsewhere ucontext (a system call per switch).
#if defined(__x86_64__)
extern "C" void cuda_emulation_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl cuda_emulation_switch
  .type cuda_emulation_switch, @function
cuda_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emulation_switch, .-cuda_emulation_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

struct Context {
  void* sp = nullptr;
#if defined(CUDA_EMULATION_TSAN)
  void* tsan_fiber = nullptr;  // ThreadSanitizer's view of this stack (the launcher's own: its thread's)
#endif
};
void SwitchContext(Context& from, Context& to) {
#if defined(CUDA_EMULATION_TSAN)
  __tsan_switch_to_fiber(to.tsan_fiber, 0);
#endif
  cuda_emulation_switch(&from.sp, to.sp);
}
void MakeContext(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  // Stacks 64 KiB apart would put every fiber's live frames in the same cache sets; a
  // different offset per stack spreads them.
  top -= (reinterpret_cast<uintptr_t>(stack) / kStackBytes % 61) * 192;
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                    // entry's return address: it never returns
  *--sp = reinterpret_cast<uint64_t>(entry);    // where the switch's `ret` goes
  for (int reg = 0; reg < 6; ++reg) *--sp = 0;  // rbp rbx r12 r13 r14 r15
  c.sp = sp;
#if defined(CUDA_EMULATION_TSAN)
  if (c.tsan_fiber == nullptr) c.tsan_fiber = __tsan_create_fiber(0);
#endif
}
#else
struct Context {
  ucontext_t uc;
};
void SwitchContext(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
void MakeContext(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  Context context;
  State state = State::kRunnable;
  ThreadCoords coords;
  uint64_t shuffles = 0;  // picks the half of the warp's exchange buffer
  int next = -1;          // the fiber after it in BlockRun's order; -1 for the last
};

// One block being run on this thread.
struct BlockRun {
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  int current = -1;
  Context scheduler;
  std::string error;
  int at_block_barrier = 0;
  int done = 0;
  std::vector<int> at_warp_barrier;  // per warp
  std::vector<double> exchange;      // [warp][2][lane]: a float or a double, exactly
  std::vector<uint32_t> mma_exchange;  // [warp][2][lane][kMmaRegs]: each lane's A and B registers
  // The order threads run in, drawn per block and again at each __syncthreads: the warps in a
  // random order, each warp's lanes together, from a drawn lane up or down. A warp whose shuffle is
  // released runs on at once (`run_ahead`: up to its next __syncthreads, overtaking the warps
  // after it) or in the next pass, as a device may schedule warps either way.
  int first = 0;                // the first fiber in the order
  std::vector<int> warp_first;  // per warp: its first fiber in the order
  std::vector<int> warp_order;
  bool run_ahead = false;
  attnserve::SplitMix64 draw{0};  // the launches' draws, cheap to seed once per launch
#if defined(CUDA_EMULATION_ASAN)
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

// Blocks run one at a time in the process: __shared__ variables are plain statics (simt.h).
std::recursive_mutex blocks_running;

// The __shared__ variables of this module (the linker's bounds of their section; null when the
// module has none). Hidden: a plugin's emulation poisons its own kernels' shared memory, never
// that of another module loaded in the same process.
extern "C" char __start_cuda_emulation_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cuda_emulation_shared[] __attribute__((weak, visibility("hidden")));

// What a block finds in shared memory that it has not written: NaN for floats and doubles.
void PoisonSharedMemory() {
  if (__start_cuda_emulation_shared == nullptr) return;
  std::memset(__start_cuda_emulation_shared, 0xff,
              static_cast<size_t>(__stop_cuda_emulation_shared - __start_cuda_emulation_shared));
}

thread_local BlockRun* run = nullptr;
// Stacks are kept between launches of a thread: a launch of 256 threads reuses 16 MiB.
thread_local std::vector<std::unique_ptr<char[]>> stacks;

Fiber& Current() { return run->fibers[run->current]; }

// The first fiber of this pass that can run, from fiber `t` on in the order; -1 when the pass
// is over.
int NextRunnable(const BlockRun& r, int t) {
  if (!r.error.empty()) return -1;
  for (; t >= 0; t = r.fibers[t].next) {
    if (r.fibers[t].state == State::kRunnable) return t;
  }
  return -1;
}

// Draws the order of the block's threads for the next pass (see BlockRun::order).
void DrawOrder(BlockRun& r) {
  const int threads = static_cast<int>(r.fibers.size()), warps = static_cast<int>(r.warp_first.size());
  r.warp_order.resize(warps);
  for (int w = 0; w < warps; ++w) r.warp_order[w] = w;
  std::shuffle(r.warp_order.begin(), r.warp_order.end(), r.draw);
  int* link = &r.first;  // where the next fiber in the order is to be written
  for (const int w : r.warp_order) {
    // The lanes from a drawn one on, up or down: a full shuffle would cost a third more time
    // in fiber switches (their stacks visited in no order the cache can follow).
    const int lanes = std::min(threads, (w + 1) * kWarp) - w * kWarp;
    const uint64_t bits = r.draw();
    const int first = static_cast<int>(bits % lanes), step = bits & (uint64_t{1} << 63) ? 1 : lanes - 1;
    r.warp_first[w] = w * kWarp + first;
    for (int i = 0, lane = first; i < lanes; ++i) {
      *link = w * kWarp + lane;
      link = &r.fibers[*link].next;
      lane += step;
      if (lane >= lanes) lane -= lanes;
    }
  }
  *link = -1;
  r.run_ahead = r.draw() & 1;
}

// From the scheduler into the pass's first runnable fiber; back when the pass is over.
void EnterFiber(int index) {
  run->current = index;
#if defined(CUDA_EMULATION_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, stacks[index].get(), kStackBytes);
  SwitchContext(run->scheduler, run->fibers[index].context);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  SwitchContext(run->scheduler, run->fibers[index].context);
#endif
  run->current = -1;
}

// The running fiber waits (or has finished): straight on to the pass's next runnable fiber from
// fiber `from` on (by default the one after it) — one switch, not two through the scheduler —
// or back to the scheduler after the last.
void SwitchAway(bool finished, int from = -2) {
  BlockRun* r = run;
  const int self = r->current, next = NextRunnable(*r, from == -2 ? r->fibers[self].next : from);
  if (next == self) return;  // its own warp's shuffle, released: it runs on
  Context& to = next >= 0 ? r->fibers[next].context : r->scheduler;
  r->current = next;
#if defined(CUDA_EMULATION_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, next >= 0 ? stacks[next].get() : r->scheduler_stack_bottom,
                                 next >= 0 ? kStackBytes : r->scheduler_stack_size);
  SwitchContext(r->fibers[self].context, to);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)finished;
  SwitchContext(r->fibers[self].context, to);
#endif
  run->current = self;
}

[[noreturn]] void FiberEntry() {
#if defined(CUDA_EMULATION_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  (*run->body)();
  Current().state = State::kDone;
  run->done++;
  SwitchAway(/*finished=*/true);
  std::abort();  // a finished fiber is never resumed
}

std::string Where(const Fiber& f) {
  return "block " + std::to_string(f.coords.block_idx.x) + " thread " + std::to_string(f.coords.thread_idx.x);
}

// Lanes of warp w that exist (the last warp of a block may be partial).
int LanesOf(const BlockRun& r, int warp) {
  return std::min<int>(kWarp, static_cast<int>(r.fibers.size()) - warp * kWarp);
}

// Releases every barrier all of whose threads have arrived; true if any was.
bool ReleaseBarriers(BlockRun& r) {
  bool released = false;
  const int threads = static_cast<int>(r.fibers.size());
  const int done = r.done;
  if (r.at_block_barrier > 0 && r.at_block_barrier == threads) {
    for (Fiber& f : r.fibers) f.state = State::kRunnable;
    r.at_block_barrier = 0;
    DrawOrder(r);
    released = true;
  } else if (r.at_block_barrier > 0 && r.at_block_barrier + done == threads && r.error.empty()) {
    r.error = "__syncthreads reached by " + std::to_string(r.at_block_barrier) + " of " + std::to_string(threads) +
              " threads; the others had exited (undefined behaviour on a device)";
  }
  for (size_t w = 0; w < r.at_warp_barrier.size(); ++w) {
    if (r.at_warp_barrier[w] == 0 || r.at_warp_barrier[w] < LanesOf(r, static_cast<int>(w))) continue;
    for (int lane = 0; lane < LanesOf(r, static_cast<int>(w)); ++lane) {
      r.fibers[w * kWarp + lane].state = State::kRunnable;
    }
    r.at_warp_barrier[w] = 0;
    released = true;
  }
  return released;
}

// Runs one block to the end; returns "" or what went wrong.
std::string RunBlock(BlockRun& r) {
  const int threads = static_cast<int>(r.fibers.size());
  for (;;) {
    const int first = NextRunnable(r, r.first);
    const bool ran = first >= 0;
    if (ran) EnterFiber(first);
    if (!r.error.empty()) return r.error;
    if (r.done == threads) return "";
    if (!ReleaseBarriers(r) && !ran) {
      std::string states;
      for (const Fiber& f : r.fibers) {
        states += f.state == State::kDone ? 'D' : f.state == State::kAtBlockBarrier ? 'B' : 'W';
      }
      return r.error.empty() ? "threads wait at barriers that can never be released (D done, B __syncthreads, "
                               "W warp shuffle): " +
                                   states
                             : r.error;
    }
  }
}

// Out of line, so the shuffle's own frame stays small: every fiber switch touches it.
[[gnu::noinline]] void UnsupportedShuffle(const Fiber& self, unsigned mask, int width) {
  if (run->error.empty()) {
    run->error = "__shfl_xor_sync at " + Where(self) + ": mask " + std::to_string(mask) + " width " +
                 std::to_string(width) + " (emulated: the full warp's mask and width 32 only)";
  }
  SwitchAway(false);  // the scheduler stops at the error and never resumes this fiber
}

}  // namespace

const ThreadCoords& Coords() { return Current().coords; }

void SyncThreads() {
  run->at_block_barrier++;
  Current().state = State::kAtBlockBarrier;
  SwitchAway(false);
}

namespace {

// Waits until every lane of `warp` has arrived at its collective (a shuffle or an mma), having
// written its values first.
void WarpRendezvous(BlockRun& r, Fiber& self, int warp, int lanes) {
  self.state = State::kAtWarpBarrier;
  if (++r.at_warp_barrier[warp] == lanes && r.run_ahead) {
    // The last lane to arrive releases the collective; the warp runs on from its first lane.
    for (int l = 0; l < lanes; ++l) r.fibers[warp * kWarp + l].state = State::kRunnable;
    r.at_warp_barrier[warp] = 0;
    SwitchAway(false, r.warp_first[warp]);
  } else {
    SwitchAway(false);
  }
}

}  // namespace

double ShuffleXor(unsigned mask, double value, int lane_mask, int width) {
  BlockRun& r = *run;
  Fiber& self = Current();
  const int thread = static_cast<int>(self.coords.thread_idx.x), warp = thread / kWarp, lane = thread % kWarp;
  const int lanes = LanesOf(r, warp);
  const unsigned everyone = lanes == kWarp ? 0xffffffffu : (1u << lanes) - 1;
  if (mask != everyone || width != kWarp) UnsupportedShuffle(self, mask, width);
  // The other half of the buffer takes the next collective, so no lane overwrites a value
  // another lane has yet to read.
  double* slots = &r.exchange[(warp * 2 + self.shuffles % 2) * kWarp];
  self.shuffles++;
  slots[lane] = value;
  WarpRendezvous(r, self, warp, lanes);
  return slots[(lane ^ lane_mask) % kWarp];
}

namespace {

// A 16-bit value of an mma operand, widened exactly.
float Widen(uint32_t bits16, MmaType type) {
  if (type == MmaType::kFp16) return __half2float(__half{static_cast<unsigned short>(bits16)});
  const uint32_t bits = bits16 << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Element i (0 low, 1 high) of a register of two 16-bit values.
float Half(uint32_t reg, int i, MmaType type) { return Widen(i == 0 ? reg & 0xffffu : reg >> 16, type); }

}  // namespace

void MmaM16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2], MmaType type) {
  BlockRun& r = *run;
  Fiber& self = Current();
  const int thread = static_cast<int>(self.coords.thread_idx.x), warp = thread / kWarp, lane = thread % kWarp;
  const int lanes = LanesOf(r, warp);
  if (lanes != kWarp && r.error.empty()) {
    r.error = "mma.sync at " + Where(self) + ": a warp of " + std::to_string(lanes) + " lanes (it takes all 32)";
  }
  uint32_t* slots = &r.mma_exchange[(warp * 2 + self.shuffles % 2) * kWarp * kMmaRegs];
  self.shuffles++;
  std::copy(a, a + 4, slots + lane * kMmaRegs);
  std::copy(b, b + 2, slots + lane * kMmaRegs + 4);
  WarpRendezvous(r, self, warp, lanes);
  // The PTX ISA's fragments of mma.m16n8k16 with .bf16/.f16 operands ("Matrix Fragments for
  // mma.m16n8k16 with floating point type"), groupID = lane >> 2, threadID_in_group = lane % 4:
  //   A: aᵢ (register i / 2, low half first) at row groupID (+8 for i in 2, 3, 6, 7), column
  //      threadID_in_group·2 + (i & 1) (+8 for i ≥ 4);
  //   B: bᵢ (register i / 2) at row threadID_in_group·2 + (i & 1) (+8 for i ≥ 2), column groupID;
  //   C, D: cᵢ at row groupID (+8 for i ≥ 2), column threadID_in_group·2 + (i & 1).
  float A[16][16], B[16][8];
  for (int l = 0; l < kWarp; ++l) {
    const uint32_t* regs = slots + l * kMmaRegs;
    const int group = l >> 2, in_group = l % 4;
    for (int i = 0; i < 8; ++i) {
      A[group + ((i / 2) % 2 == 1 ? 8 : 0)][in_group * 2 + (i & 1) + (i >= 4 ? 8 : 0)] = Half(regs[i / 2], i & 1, type);
    }
    for (int i = 0; i < 4; ++i) B[in_group * 2 + (i & 1) + (i >= 2 ? 8 : 0)][group] = Half(regs[4 + i / 2], i & 1, type);
  }
  const int group = lane >> 2, in_group = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = group + (i >= 2 ? 8 : 0), col = in_group * 2 + (i & 1);
    // The products of 16-bit values are exact in float; the device's order and width of the
    // sum are unspecified, so the tests' bounds allow float32's.
    float sum = d[i];
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    d[i] = sum;
  }
}

bool CheckLaunch(dim3 grid, dim3 block) {
  internal::CountKernelLaunch();
  if (internal::StickyError() != cudaSuccess) return false;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  // An injected bad configuration fails as a real one does: the launch's error, nothing queued.
  const bool injected = internal::TakeFault(Fault::kLaunchInvalid);
  if (injected || threads == 0 || threads > kMaxThreads || grid.x == 0 || grid.y == 0 || grid.z == 0 || block.y != 1 ||
      block.z != 1 || grid.y != 1 || grid.z != 1 || grid.x > 0x7fffffffu) {
    internal::Diagnose("kernel launch: invalid configuration grid " + std::to_string(grid.x) + "x" +
                       std::to_string(grid.y) + "x" + std::to_string(grid.z) + ", block " + std::to_string(block.x) +
                       "x" + std::to_string(block.y) + "x" + std::to_string(block.z) +
                       (injected ? " (injected)" : " (one-dimensional launches of 1-1024 threads are emulated)"));
    internal::SetLastError(cudaErrorInvalidConfiguration);
    return false;
  }
  if (internal::TakeFault(Fault::kKernel)) {
    internal::RaiseFault(internal::InjectedError(cudaErrorLaunchFailure), "injected fault in a kernel");
    return false;
  }
  return true;
}

void RunBlocks(dim3 grid, dim3 block, const std::function<void()>& body) {
  if (internal::StickyError() != cudaSuccess) return;
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  while (stacks.size() < threads) stacks.push_back(std::make_unique<char[]>(kStackBytes));
  BlockRun r;
  r.body = &body;
#if defined(CUDA_EMULATION_ASAN)
  pthread_attr_t attr;
  void* stack_addr = nullptr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    pthread_attr_getstack(&attr, &stack_addr, &r.scheduler_stack_size);
    pthread_attr_destroy(&attr);
  }
  r.scheduler_stack_bottom = stack_addr;
#endif
  r.fibers.resize(threads);
#if defined(CUDA_EMULATION_TSAN)
  r.scheduler.tsan_fiber = __tsan_get_current_fiber();
  struct ReleaseFibers {  // ThreadSanitizer's fiber records of this launch, on every way out
    BlockRun& r;
    ~ReleaseFibers() {
      for (Fiber& f : r.fibers) {
        if (f.context.tsan_fiber != nullptr) __tsan_destroy_fiber(f.context.tsan_fiber);
      }
    }
  } release_fibers{r};
#endif
  const size_t warps = (threads + kWarp - 1) / kWarp;
  r.exchange.assign(warps * 2 * kWarp, 0.0);
  r.mma_exchange.assign(warps * 2 * kWarp * kMmaRegs, 0u);
  r.warp_first.assign(warps, 0);
  // The blocks in an order drawn per launch, from the run's seed: a device runs them in any.
  r.draw.state = internal::LaunchDraw();
  std::vector<unsigned> blocks(grid.x);
  for (unsigned b = 0; b < grid.x; ++b) blocks[b] = b;
  std::shuffle(blocks.begin(), blocks.end(), r.draw);
  std::lock_guard<std::recursive_mutex> one_block_at_a_time(blocks_running);
  BlockRun* outer = run;
  run = &r;
  for (const unsigned b : blocks) {
    PoisonSharedMemory();
    DrawOrder(r);
    r.at_block_barrier = 0;
    r.done = 0;
    r.at_warp_barrier.assign(warps, 0);
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = r.fibers[t];
      f.state = State::kRunnable;
      f.shuffles = 0;
      f.coords = {dim3(t), dim3(b), block, grid};
#if defined(CUDA_EMULATION_ASAN)
      // A fiber abandoned at an error may have left its frames' redzones poisoned.
      __asan_unpoison_memory_region(stacks[t].get(), kStackBytes);
#endif
      MakeContext(f.context, stacks[t].get(), kStackBytes, &FiberEntry);
    }
    if (const std::string error = RunBlock(r); !error.empty()) {
      run = outer;
      internal::RaiseFault(cudaErrorLaunchFailure, "kernel block " + std::to_string(b) + ": " + error);
      return;
    }
  }
  run = outer;
}

}  // namespace cuda_emulation
