// A spinning thread's pause between two polls of what it waits for.
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

}  // namespace attnserve
