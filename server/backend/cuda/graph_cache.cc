#include "server/backend/cuda/graph_cache.h"

#include <cuda_runtime.h>

#include <utility>

namespace attnserve::cuda {

const GraphCache::Entry* GraphCache::Find(const std::vector<int64_t>& key) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->key != key) continue;
    entries_.splice(entries_.begin(), entries_, it);
    return &entries_.front();
  }
  return nullptr;
}

void GraphCache::Insert(std::vector<int64_t> key, cudaGraphExec_t exec, std::vector<const void*> pointers) {
  if (capacity_ == 0) {
    cudaGraphExecDestroy(exec);
    return;
  }
  while (entries_.size() >= capacity_) {
    cudaGraphExecDestroy(entries_.back().exec);
    entries_.pop_back();
  }
  entries_.push_front({std::move(key), exec, std::move(pointers)});
}

void GraphCache::Clear() {
  for (Entry& e : entries_) cudaGraphExecDestroy(e.exec);
  entries_.clear();
}

}  // namespace attnserve::cuda
