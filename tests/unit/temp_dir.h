// A fresh temporary folder for a test, removed with everything in it by the destructor.
// Header-only, so every test binary can use it whatever it links.
// Thread-safety: create and use from one thread; distinct instances never share a folder.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace attnserve::testing {

class TempDir {
 public:
  TempDir() {
    // mkdtemp: unique even across test binaries that ctest runs in parallel.
    std::string pattern = (std::filesystem::temp_directory_path() / "attnserve_test_XXXXXX").string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace attnserve::testing
