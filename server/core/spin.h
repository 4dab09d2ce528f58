// How a spinning thread waits: its pause between two polls of what it waits for, and, in an idle
// spin, its way of giving the core to any thread that is ready to run there.
// Thread-safety: none needed (no state).
#pragma once

#include <thread>

namespace attnserve {

// x86's PAUSE: a spin loop releases the core's shared resources to its sibling and does not
// flood the memory system with speculative loads of the flag it polls.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// An idle spin reads the clock, and gives way (YieldToReadyThreads), once every this many polls
// (about 1–2 µs of PAUSEs).
constexpr int kPollsPerTurn = 64;

// How long a thread that saw news by spinning polls for the lock it was published under before
// it blocks (MutexLock::LockSpinning): a few µs, far more than a publisher holds it for, unless
// the publisher lost its core meanwhile, when blocking is the better wait.
constexpr int kLockPolls = 4 * kPollsPerTurn;

// An idle spin's turn to give way. A thread spins while idle (a batch worker between requests,
// a compute helper between forwards) so that its vCPU does not go idle: on a VM the next forward
// runs slower on a vCPU that halted (docs/journal/benchmarks-journal.md, "Serving overhead"). It must not take
// the core from the threads the next request needs meanwhile, gRPC's, sending this answer and
// taking the next: the scheduler shares a core fairly between runnable threads, so a spinner
// that never yields takes half of it from a busy thread beside it, and one that yields every
// turn almost none. When no other thread is ready this returns at once and the spin goes on.
// Not for the spin inside a forward's step, which waits for its own team's member.
inline void YieldToReadyThreads() { std::this_thread::yield(); }

}  // namespace attnserve
