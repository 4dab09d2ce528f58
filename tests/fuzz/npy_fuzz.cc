// libFuzzer target: bytes → ParseNpy (client/npy.h), the CLI's .npy reader. Nothing may crash;
// an accepted array must hold exactly its shape's element count, and its image (SerializeNpy)
// must parse back to the same shape.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "client/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using attnserve::NpyArray;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  NpyArray array;
  if (!attnserve::ParseNpy(bytes, "fuzz.npy", &array).ok()) return 0;
  size_t elements = 1;
  for (int64_t d : array.shape) elements *= static_cast<size_t>(d);
  if (elements != array.data.size()) {
    std::fprintf(stderr, "npy fuzz: %zu values for a shape of %zu elements\n", array.data.size(), elements);
    std::abort();
  }
  std::string image;
  NpyArray again;
  const grpc::Status written = attnserve::SerializeNpy(array, &image);
  const grpc::Status reread = written.ok() ? attnserve::ParseNpy(image, "fuzz-again.npy", &again) : written;
  if (!reread.ok() || again.shape != array.shape || again.data.size() != array.data.size()) {
    std::fprintf(stderr, "npy fuzz: an accepted array does not round-trip: %s\n", reread.error_message().c_str());
    std::abort();
  }
  return 0;
}
