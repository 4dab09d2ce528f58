// libFuzzer target: bytes → a file → ReadSafetensors (server/store/safetensors.h), then
// ReadFloat of every tensor its header lists. Nothing may crash; a tensor the header accepted
// must read back as its shape's element count of values (or a clean error for non-float dtypes).
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "server/store/safetensors.h"

namespace {

using namespace attnserve;

// One file in a fresh folder, rewritten for every input (libFuzzer runs inputs one after
// another). In memory (/dev/shm) where there is one: on a disk, the write and the reads of
// every input make the target about 50 times slower.
std::string* folder = nullptr;

const std::string& InputPath() {
  static const std::string path = [] {
    const std::filesystem::path base =
        ::access("/dev/shm", W_OK | X_OK) == 0 ? std::filesystem::path("/dev/shm") : std::filesystem::temp_directory_path();
    std::string pattern = (base / "attnserve_fuzz_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("safetensors fuzz: mkdtemp");
      std::abort();
    }
    folder = new std::string(pattern);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(*folder, ec);
    });
    return *folder + "/input.safetensors";
  }();
  return path;
}

void WriteFile(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::perror("safetensors fuzz: open");
    std::abort();
  }
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) {
      std::perror("safetensors fuzz: write");
      std::abort();
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = InputPath();
  WriteFile(path, data, size);
  StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  if (!file.ok()) return 0;
  for (const TensorInfo& info : file->tensors()) {
    StatusOr<FloatTensor> tensor = file->ReadFloat(info.name);
    if (!tensor.ok()) {
      if (IsFloatDtype(info.dtype)) {
        std::fprintf(stderr, "safetensors fuzz: header accepted float tensor '%s' but ReadFloat failed: %s\n",
                     info.name.c_str(), tensor.status().ToString().c_str());
        std::abort();
      }
      continue;
    }
    if (static_cast<int64_t>(tensor->values.size()) != info.elements || tensor->shape != info.shape) {
      std::fprintf(stderr, "safetensors fuzz: '%s' read %zu values, header says %lld\n", info.name.c_str(),
                   tensor->values.size(), static_cast<long long>(info.elements));
      std::abort();
    }
  }
  return 0;
}
