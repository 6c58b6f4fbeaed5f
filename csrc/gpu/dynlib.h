// Loading a shared library at run time, by the first of several candidate paths, and looking
// up its symbols. GPU runtimes and compilers are never linked: a GPU-less install must import.
#pragma once

#include <dlfcn.h>

#include <string>
#include <vector>

namespace jaxfuse::gpu {

class DynamicLibrary {
 public:
  // Tries each candidate in order (paths or bare sonames); remembers why each one failed.
  explicit DynamicLibrary(const std::vector<std::string>& candidates) {
    for (const std::string& name : candidates) {
      handle_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle_ != nullptr) {
        path_ = name;
        return;
      }
      const char* err = dlerror();
      errors_ += "\n  " + name + ": " + (err ? err : "not found");
    }
  }
  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;
  // Never dlclose: function pointers into it may live in static tables until exit.

  bool loaded() const { return handle_ != nullptr; }
  const std::string& path() const { return path_; }
  const std::string& errors() const { return errors_; }

  // Looks up `name` into `fn`; returns false if it is missing.
  template <typename Fn>
  bool Get(const char* name, Fn* fn) const {
    *fn = handle_ ? reinterpret_cast<Fn>(dlsym(handle_, name)) : nullptr;
    return *fn != nullptr;
  }

 private:
  void* handle_ = nullptr;
  std::string path_;
  std::string errors_;
};

}  // namespace jaxfuse::gpu
