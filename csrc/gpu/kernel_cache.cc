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

// The whole file, or false if it cannot be read. (POSIX I/O: see codegen.cc on iostreams.)
bool ReadFile(const std::string& path, std::string* contents) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  contents->clear();
  char buffer[1 << 16];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) contents->append(buffer, n);
  close(fd);
  return n == 0;
}

// Parses a cache file; returns false if anything is off.
bool Parse(const std::string& text, std::string* key, std::string* payload) {
  const size_t magic_len = sizeof(kMagic) - 1;
  if (text.compare(0, magic_len, kMagic) != 0) return false;
  size_t pos = magic_len;
  auto read_number = [&](uint64_t* value, int base) {
    const size_t end = text.find('\n', pos);
    if (end == std::string::npos || end == pos || end - pos > 20) return false;
    char* stop = nullptr;
    const std::string field = text.substr(pos, end - pos);
    *value = std::strtoull(field.c_str(), &stop, base);
    if (stop == nullptr || *stop != '\0') return false;
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

void DiskCache::Configure(const std::string& directory) {
  std::lock_guard<std::mutex> lock(mu_);
  directory_ = directory;
  problem_.clear();
  checked_ = false;
}

std::string DiskCache::directory() const {
  std::lock_guard<std::mutex> lock(mu_);
  return directory_;
}

std::string DiskCache::problem() const {
  std::lock_guard<std::mutex> lock(mu_);
  return problem_;
}

bool DiskCache::Usable() {
  if (directory_.empty()) return false;
  if (checked_) return problem_.empty();
  checked_ = true;
  if (!MakeDirs(directory_)) {
    problem_ = "cannot create " + directory_ + ": " + std::strerror(errno);
    return false;
  }
  struct stat st {};
  if (stat(directory_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    problem_ = directory_ + " is not a directory";
    return false;
  }
  if (st.st_uid != geteuid()) {
    problem_ = directory_ + " belongs to another user; kernels are not loaded from it";
    return false;
  }
  if (st.st_mode & (S_IWGRP | S_IWOTH)) {
    problem_ = directory_ + " is writable by other users; kernels are not loaded from it "
               "(chmod 700 it to use it)";
    return false;
  }
  if (access(directory_.c_str(), W_OK) != 0) {
    problem_ = "cannot write to " + directory_ + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

std::string DiskCache::PathFor(const std::string& key) const {
  return directory_ + "/" + Hex(Fnv1a64(key)) + Hex(Fnv1a64(key, 0x84222325cbf29ce4ull)) +
         kSuffix;
}

bool DiskCache::Load(const std::string& key, std::string* binary) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!Usable()) return false;
  const std::string path = PathFor(key);
  std::string contents, stored_key;
  if (!ReadFile(path, &contents)) return false;
  if (Parse(contents, &stored_key, binary) && stored_key == key) return true;
  std::remove(path.c_str());  // truncated, corrupted or a colliding key: rebuild it
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
  DIR* dir = directory_.empty() ? nullptr : opendir(directory_.c_str());
  if (dir == nullptr) return keys;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.size() <= 4 || name.compare(name.size() - 4, 4, kSuffix) != 0) continue;
    std::string contents, key, payload;
    if (ReadFile(directory_ + "/" + name, &contents) && Parse(contents, &key, &payload)) {
      keys.push_back(key);
    }
  }
  closedir(dir);
  return keys;
}

}  // namespace jaxfuse::gpu
