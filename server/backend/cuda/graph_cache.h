// A lane's CUDA graphs of small batches (CudaBackendOptions::graph_rows): each instantiated graph
// under the signature of the batch it was captured from, the least recently used dropped past a
// small bound. docs/architecture.md, "The CUDA backend", "CUDA graphs".
// Thread-safety: a GraphCache serves one lane, on that lane's thread (or, idle, the thread that
// reclaims its workspace and so clears it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <vector>

namespace attnserve::cuda {

class GraphCache {
 public:
  // One captured batch: its signature (Lane::GraphKey), its instantiation, and the pointer
  // arena's contents its pointer-array GEMMs read (copied in before each launch: CublasOps stages
  // them outside the graph, since a graph's copy from pinned memory would read whatever the
  // arena holds when it runs).
  struct Entry {
    std::vector<int64_t> key;
    cudaGraphExec_t exec = nullptr;
    std::vector<const void*> pointers;
  };

  explicit GraphCache(size_t capacity) : capacity_(capacity) {}
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;
  ~GraphCache() { Clear(); }

  // The entry captured under `key`, now the most recently used; nullptr when there is none.
  const Entry* Find(const std::vector<int64_t>& key);
  // Keeps `exec` (destroyed with the entry), dropping the least recently used past the bound.
  void Insert(std::vector<int64_t> key, cudaGraphExec_t exec, std::vector<const void*> pointers);
  // Destroys every instantiation: their pointers into the workspace are stale once it goes.
  void Clear();
  size_t size() const { return entries_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  const size_t capacity_;
  std::list<Entry> entries_;  // the most recently used first
};

}  // namespace attnserve::cuda
