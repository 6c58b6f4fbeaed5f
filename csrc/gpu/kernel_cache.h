// The on-disk kernel cache ($JAXFUSE_CACHE_DIR, default ~/.cache/jaxfuse): one file per
// compiled kernel, named by a hash of its key. Files are written to a temporary name and
// renamed, so readers in other processes never see half a file; every read checks that the
// entry is a regular file this user owns and no one else may write, then the magic, the full
// key and a checksum, and an entry that fails is deleted and rebuilt. Only a directory owned by
// this user and not writable by others is used (loaded code is executed). SECURITY.md says
// what this protects against.
#pragma once

#include <mutex>
#include <string>
#include <vector>

namespace jaxfuse::gpu {

class DiskCache {
 public:
  static DiskCache& Global();

  // Uses `directory` (created 0700 if missing; checked on first use); "" turns disk caching
  // off, for the reason `why_off` if one is given (a path that could not be resolved). A
  // directory that fails the checks, or a failed write, turns it off too (problem()).
  void Configure(const std::string& directory, const std::string& why_off = "");
  std::string directory() const;
  // Empty while the disk cache works; otherwise why it is off (for one Python warning and
  // `python -m jaxfuse info`). Before first use, what the checks would find, creating nothing.
  std::string problem() const;

  // True and fills `binary` on a verified hit; false on a miss or a discarded bad file.
  bool Load(const std::string& key, std::string* binary);
  void Store(const std::string& key, const std::string& binary);

  // The keys of every readable entry (for `python -m jaxfuse info`); none while it is off.
  std::vector<std::string> Keys() const;

 private:
  std::string PathFor(const std::string& key) const;
  bool Usable();  // with mu_ held
  std::string CurrentProblem() const;  // with mu_ held
  mutable std::mutex mu_;
  std::string directory_;
  std::string problem_;
  bool checked_ = false;
};

// FNV-1a, 64 bits: file names and checksums (integrity, not security: the directory is).
uint64_t Fnv1a64(const std::string& data, uint64_t seed = 0xcbf29ce484222325ull);

}  // namespace jaxfuse::gpu
