#include "gpu/kernel_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

namespace jaxfuse::gpu {
namespace {

constexpr char kMagic[] = "JAXFUSE-KERNEL 1\n";
constexpr char kSuffix[] = ".jfk";

std::string Hex(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

bool MakeDirs(const std::string& path) {
  for (size_t end = path.find('/', 1); ; end = path.find('/', end + 1)) {
    const std::string partial = path.substr(0, end);
    if (!partial.empty() && mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) return false;
    if (end == std::string::npos) return true;
  }
}

// No kernel binary comes near this; a bigger file is not ours and is not read into memory.
constexpr off_t kMaxFileBytes = off_t{1} << 30;

enum class Entry { kMissing, kBad, kGood };

// Reads the cache entry at `path` into `contents`. An entry is good only if it is a regular
// file this user owns that no one else may write (loaded code is executed) and of a sane
// size; anything else there (a link, a FIFO, a directory, a foreign file) is kBad. `seen` is
// what the entry was, for DiscardIfUnchanged. (POSIX I/O: see codegen.cc on iostreams.)
Entry ReadEntry(const std::string& path, std::string* contents, struct stat* seen) {
  if (lstat(path.c_str(), seen) != 0) return Entry::kMissing;
  if (!S_ISREG(seen->st_mode) || seen->st_uid != geteuid() ||
      (seen->st_mode & (S_IWGRP | S_IWOTH)) || seen->st_size > kMaxFileBytes) {
    return Entry::kBad;
  }
  // O_NONBLOCK: should the entry be swapped for a FIFO after lstat, open must not wait on it.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return Entry::kMissing;  // replaced or removed meanwhile: a plain miss
  struct stat now {};
  if (fstat(fd, &now) != 0 || now.st_dev != seen->st_dev || now.st_ino != seen->st_ino) {
    close(fd);
    return Entry::kMissing;
  }
  contents->clear();
  contents->reserve(static_cast<size_t>(now.st_size));
  char buffer[1 << 16];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) {
    contents->append(buffer, static_cast<size_t>(n));
    if (contents->size() > static_cast<size_t>(kMaxFileBytes)) break;
  }
  close(fd);
  return n == 0 ? Entry::kGood : Entry::kBad;
}

// Deletes a bad entry, unless another process has meanwhile renamed a fresh file into its
// place (then the fresh file stays).
void DiscardIfUnchanged(const std::string& path, const struct stat& seen) {
  struct stat now {};
  if (lstat(path.c_str(), &now) == 0 && now.st_dev == seen.st_dev && now.st_ino == seen.st_ino) {
    if (S_ISDIR(now.st_mode)) {
      rmdir(path.c_str());  // only if empty; otherwise it stays a miss every time
    } else {
      unlink(path.c_str());
    }
  }
}

// Parses a cache file; returns false if anything is off.
bool Parse(const std::string& text, std::string* key, std::string* payload) {
  const size_t magic_len = sizeof(kMagic) - 1;
  if (text.compare(0, magic_len, kMagic) != 0) return false;
  size_t pos = magic_len;
  // A decimal or hexadecimal number on a line of its own: digits only, no sign, no spaces,
  // short enough not to overflow.
  auto read_number = [&](uint64_t* value, int base) {
    const size_t end = text.find('\n', pos);
    const size_t max_digits = base == 16 ? 16 : 19;
    if (end == std::string::npos || end == pos || end - pos > max_digits) return false;
    uint64_t result = 0;
    for (size_t i = pos; i < end; ++i) {
      const char c = text[i];
      int digit;
      if (c >= '0' && c <= '9') digit = c - '0';
      else if (base == 16 && c >= 'a' && c <= 'f') digit = c - 'a' + 10;
      else return false;
      result = result * static_cast<uint64_t>(base) + static_cast<uint64_t>(digit);
    }
    *value = result;
    pos = end + 1;
    return true;
  };
  uint64_t key_size = 0, payload_size = 0, checksum = 0;
  if (!read_number(&key_size, 10) || key_size > text.size() - pos) return false;
  *key = text.substr(pos, key_size);
  pos += key_size;
  if (pos >= text.size() || text[pos] != '\n') return false;
  ++pos;
  if (!read_number(&payload_size, 10) || !read_number(&checksum, 16)) return false;
  if (payload_size != text.size() - pos) return false;  // truncated or padded
  *payload = text.substr(pos);
  return Fnv1a64(*key + *payload) == checksum;
}

// Why the existing `directory` may not hold the cache (loaded code is executed); empty when
// it may.
std::string DirectoryProblem(const std::string& directory) {
  struct stat st {};
  if (stat(directory.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return directory + " is not a directory";
  }
  if (st.st_uid != geteuid()) {
    return directory + " belongs to another user; kernels are not loaded from it";
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    return directory + " is writable by other users; kernels are not loaded from it "
           "(chmod 700 it to use it)";
  }
  if (access(directory.c_str(), W_OK) != 0) {
    return "cannot write to " + directory + ": " + std::strerror(errno);
  }
  return "";
}

// What the first use of `directory` would find, creating nothing: the checks above if it
// exists; if not, whether its nearest existing ancestor lets it be created.
std::string InspectDirectory(const std::string& directory) {
  struct stat st {};
  if (stat(directory.c_str(), &st) == 0) return DirectoryProblem(directory);
  if (errno != ENOENT) return "cannot create " + directory + ": " + std::strerror(errno);
  std::string ancestor = directory;
  do {
    const size_t slash = ancestor.find_last_of('/');
    ancestor = slash == std::string::npos ? "." : slash == 0 ? "/" : ancestor.substr(0, slash);
  } while (stat(ancestor.c_str(), &st) != 0 && errno == ENOENT && ancestor != "/" &&
           ancestor != ".");
  if (stat(ancestor.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
      access(ancestor.c_str(), W_OK | X_OK) != 0) {
    return "cannot create " + directory + ": " + ancestor + " is not a writable directory";
  }
  return "";
}

}  // namespace

uint64_t Fnv1a64(const std::string& data, uint64_t seed) {
  uint64_t hash = seed;
  for (unsigned char c : data) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

DiskCache& DiskCache::Global() {
  static auto* cache = new DiskCache();
  return *cache;
}

void DiskCache::Configure(const std::string& directory, const std::string& why_off) {
  std::lock_guard<std::mutex> lock(mu_);
  directory_ = directory;
  problem_ = directory.empty() ? why_off : "";
  checked_ = false;
}

std::string DiskCache::directory() const {
  std::lock_guard<std::mutex> lock(mu_);
  return directory_;
}

std::string DiskCache::problem() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CurrentProblem();
}

std::string DiskCache::CurrentProblem() const {
  if (checked_ || directory_.empty()) return problem_;
  return InspectDirectory(directory_);
}

bool DiskCache::Usable() {
  if (directory_.empty()) return false;
  if (checked_) return problem_.empty();
  checked_ = true;
  if (!MakeDirs(directory_)) {
    problem_ = "cannot create " + directory_ + ": " + std::strerror(errno);
    return false;
  }
  problem_ = DirectoryProblem(directory_);
  return problem_.empty();
}

std::string DiskCache::PathFor(const std::string& key) const {
  return directory_ + "/" + Hex(Fnv1a64(key)) + Hex(Fnv1a64(key, 0x84222325cbf29ce4ull)) +
         kSuffix;
}

bool DiskCache::Load(const std::string& key, std::string* binary) {
  std::lock_guard<std::mutex> lock(mu_);
  binary->clear();
  if (!Usable()) return false;
  const std::string path = PathFor(key);
  std::string contents, stored_key;
  struct stat seen {};
  const Entry entry = ReadEntry(path, &contents, &seen);
  if (entry == Entry::kMissing) return false;
  if (entry == Entry::kGood && Parse(contents, &stored_key, binary) && stored_key == key) {
    return true;
  }
  // Truncated, corrupted, a colliding key, or not a file of ours: rebuild it.
  DiscardIfUnchanged(path, seen);
  binary->clear();
  return false;
}

void DiskCache::Store(const std::string& key, const std::string& binary) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Usable()) return;
  const std::string path = PathFor(key);
  std::random_device entropy;
  const std::string temp = path + ".tmp" + std::to_string(getpid()) + "_" +
                           std::to_string(entropy());
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    problem_ = "cannot write to " + directory_ + ": " + std::strerror(errno);
    return;
  }
  std::string text = kMagic;
  text += std::to_string(key.size()) + "\n" + key + "\n" + std::to_string(binary.size()) + "\n" +
          Hex(Fnv1a64(key + binary)) + "\n" + binary;
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = write(fd, text.data() + written, text.size() - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  const bool ok = written == text.size() && fsync(fd) == 0;
  close(fd);
  if (!ok || std::rename(temp.c_str(), path.c_str()) != 0) {
    problem_ = "cannot write to " + directory_ + ": " + std::strerror(errno);
    std::remove(temp.c_str());
  }
}

std::vector<std::string> DiskCache::Keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> keys;
  // Entries of a directory that is off are not read (another user may have written them).
  DIR* dir = directory_.empty() || !CurrentProblem().empty() ? nullptr
                                                             : opendir(directory_.c_str());
  if (dir == nullptr) return keys;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.size() <= 4 || name.compare(name.size() - 4, 4, kSuffix) != 0) continue;
    std::string contents, key, payload;
    struct stat seen {};
    if (ReadEntry(directory_ + "/" + name, &contents, &seen) == Entry::kGood &&
        Parse(contents, &key, &payload)) {
      keys.push_back(key);
    }
  }
  closedir(dir);
  return keys;
}

}  // namespace jaxfuse::gpu
