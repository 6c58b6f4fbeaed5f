#include "gpu/runtime.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "gpu/backend.h"
#include "gpu/dynlib.h"
#include "gpu/embedded_sources.h"

namespace jaxfuse::gpu {
namespace {

// Opaque handle types of both runtimes, declared here so no SDK header is needed to build.
using Handle = void*;
using Result = int;  // CUresult / hipError_t / nvrtcResult / hiprtcResult: 0 is success

std::mutex search_mu;
std::vector<std::string>& SearchPaths() {
  static auto* paths = new std::vector<std::string>();
  return *paths;
}

std::vector<std::string> Candidates(const char* env, const std::vector<std::string>& names,
                                    const std::vector<std::string>& system_dirs) {
  std::vector<std::string> out;
  if (const char* forced = std::getenv(env); forced != nullptr && *forced) out.push_back(forced);
  std::vector<std::string> dirs;
  {
    std::lock_guard<std::mutex> lock(search_mu);
    dirs = SearchPaths();
  }
  dirs.insert(dirs.end(), system_dirs.begin(), system_dirs.end());
  for (const std::string& dir : dirs) {
    for (const std::string& name : names) out.push_back(dir + "/" + name);
  }
  out.insert(out.end(), names.begin(), names.end());  // the dynamic loader's own search
  return out;
}

template <typename Fn>
void Require(const DynamicLibrary& lib, const char* name, Fn* fn) {
  if (!lib.Get(name, fn)) {
    throw std::runtime_error(std::string("jaxfuse: ") + lib.path() + " has no symbol " + name);
  }
}

}  // namespace

const char* PlatformName(Platform platform) {
  return platform == Platform::kCuda ? "CUDA" : "ROCM";
}

void SetCompilerSearchPaths(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(search_mu);
  SearchPaths() = paths;
}

// ----- runtime compiler -----------------------------------------------------------------------

struct RuntimeCompiler::Api {
  std::unique_ptr<DynamicLibrary> lib;
  Result (*version)(int*, int*);
  Result (*create)(Handle*, const char*, const char*, int, const char* const*, const char* const*);
  Result (*compile)(Handle, int, const char* const*);
  Result (*log_size)(Handle, size_t*);
  Result (*log)(Handle, char*);
  Result (*code_size)(Handle, size_t*);
  Result (*code)(Handle, char*);
  Result (*destroy)(Handle*);
  const char* (*error_string)(Result);
};

RuntimeCompiler::RuntimeCompiler(Platform platform) : platform_(platform) {
  auto api = std::make_unique<Api>();
  const bool cuda = platform == Platform::kCuda;
  api->lib = std::make_unique<DynamicLibrary>(
      cuda ? Candidates("JAXFUSE_NVRTC", {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"},
                        {"/usr/local/cuda/lib64"})
           // ROCm 5 ships hiprtc inside libamdhip64; ROCm 6 splits it out.
           : Candidates("JAXFUSE_HIPRTC", {"libhiprtc.so", "libhiprtc.so.6", "libhiprtc.so.5",
                                           "libamdhip64.so.5", "libamdhip64.so"},
                        {"/opt/rocm/lib"}));
  if (!api->lib->loaded()) {
    throw std::runtime_error(std::string("jaxfuse: cannot load the runtime compiler (") +
                             (cuda ? "NVRTC" : "hiprtc") + "); tried:" + api->lib->errors() +
                             "\nInstall it (e.g. pip install nvidia-cuda-nvrtc) or set " +
                             (cuda ? "JAXFUSE_NVRTC" : "JAXFUSE_HIPRTC") + " to its path.");
  }
  const DynamicLibrary& lib = *api->lib;
  const char* p = cuda ? "nvrtc" : "hiprtc";
  auto name = [&](const char* suffix) { return std::string(p) + suffix; };
  Require(lib, name("Version").c_str(), &api->version);
  Require(lib, name("CreateProgram").c_str(), &api->create);
  Require(lib, name("CompileProgram").c_str(), &api->compile);
  Require(lib, name("GetProgramLogSize").c_str(), &api->log_size);
  Require(lib, name("GetProgramLog").c_str(), &api->log);
  Require(lib, cuda ? "nvrtcGetCUBINSize" : "hiprtcGetCodeSize", &api->code_size);
  Require(lib, cuda ? "nvrtcGetCUBIN" : "hiprtcGetCode", &api->code);
  Require(lib, name("DestroyProgram").c_str(), &api->destroy);
  Require(lib, name("GetErrorString").c_str(), &api->error_string);
  int major = 0, minor = 0;
  api->version(&major, &minor);
  version_ = std::string(p) + " " + std::to_string(major) + "." + std::to_string(minor);
  library_ = lib.path();
  // NVRTC opens its builtins library by soname when it first compiles; 13.0 does not look
  // beside itself, so an NVRTC found in a pip package's directory failed every compile
  // ("failed to open libnvrtc-builtins.so.13.0") unless that directory was on the loader's
  // path. Loaded here from beside it (best effort), the soname is already resolved.
  if (const size_t slash = library_.rfind('/'); cuda && slash != std::string::npos) {
    const std::string builtins = library_.substr(0, slash + 1) + "libnvrtc-builtins.so." +
                                 std::to_string(major) + "." + std::to_string(minor);
    (void)dlopen(builtins.c_str(), RTLD_NOW | RTLD_GLOBAL);  // kept open until exit
  }
  api_ = api.release();
}

const RuntimeCompiler& RuntimeCompiler::Get(Platform platform) {
  static std::mutex mu;
  static std::map<Platform, const RuntimeCompiler*> compilers;
  std::lock_guard<std::mutex> lock(mu);
  auto it = compilers.find(platform);
  if (it == compilers.end()) {
    it = compilers.emplace(platform, new RuntimeCompiler(platform)).first;  // lives until exit
  }
  return *it->second;
}

std::string RuntimeCompiler::Compile(const std::string& source, const std::string& arch) const {
  std::vector<const char*> header_texts, header_names;
  for (int i = 0; i < kNumEmbeddedSources; ++i) {
    header_names.push_back(kEmbeddedSources[i].name);
    header_texts.push_back(kEmbeddedSources[i].text);
  }
  Handle program = nullptr;
  Result status = api_->create(&program, source.c_str(), "jaxfuse_kernel.cu",
                               static_cast<int>(header_texts.size()), header_texts.data(),
                               header_names.data());
  if (status != 0) {
    throw std::runtime_error(std::string("jaxfuse: creating the kernel program failed: ") +
                             api_->error_string(status));
  }
  const std::string arch_flag = platform_ == Platform::kCuda ? "--gpu-architecture=" + arch
                                                              : "--offload-arch=" + arch;
  const std::vector<const char*> options = {arch_flag.c_str(), "-std=c++17"};
  status = api_->compile(program, static_cast<int>(options.size()), options.data());
  size_t log_size = 0;
  std::string log;
  if (api_->log_size(program, &log_size) == 0 && log_size > 1) {
    log.resize(log_size);
    api_->log(program, log.data());
    log.resize(log_size - 1);
  }
  std::string binary;
  if (status == 0) {
    size_t size = 0;
    if (api_->code_size(program, &size) == 0 && size > 0) {
      binary.resize(size);
      if (api_->code(program, binary.data()) != 0) binary.clear();
    }
  }
  api_->destroy(&program);
  if (status != 0 || binary.empty()) {
    throw std::runtime_error("jaxfuse: " + version_ + " failed to compile the kernel for " + arch +
                             ": " + api_->error_string(status) + "\ncompiler log:\n" + log);
  }
  return binary;
}

// ----- driver ---------------------------------------------------------------------------------

struct Driver::Api {
  std::unique_ptr<DynamicLibrary> lib;
  Result (*init)(unsigned);
  Result (*device_get)(int*, int);
  Result (*device_attribute)(int*, int, int);
  Result (*device_name)(char*, int, int);
  Result (*primary_ctx_retain)(Handle*, int);
  Result (*ctx_push)(Handle);
  Result (*ctx_pop)(Handle*);
  Result (*module_load_data)(Handle*, const void*);
  Result (*module_get_function)(Handle*, Handle, const char*);
  Result (*func_set_attribute)(Handle, int, int);  // CUDA only
  Result (*launch)(Handle, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   Handle, void**, void**);
  Result (*memset_d8_async)(void*, unsigned char, size_t, Handle);
  Result (*mem_alloc)(void**, size_t);
  Result (*mem_free)(void*);
  Result (*copy_htod)(void*, const void*, size_t);
  Result (*copy_dtoh)(void*, const void*, size_t);
  Result (*stream_create)(Handle*, unsigned);
  Result (*stream_destroy)(Handle);
  Result (*stream_synchronize)(Handle);
  Result (*event_create)(Handle*, unsigned);
  Result (*event_record)(Handle, Handle);
  Result (*event_synchronize)(Handle);
  Result (*event_elapsed)(float*, Handle, Handle);
  Result (*event_destroy)(Handle);
  // Stream gates (optional: absent in old drivers). HIP's wait takes a mask.
  Result (*wait_value32)(Handle, void*, uint32_t, unsigned) = nullptr;                // CUDA
  Result (*hip_wait_value32)(Handle, void*, uint32_t, unsigned, uint32_t) = nullptr;  // HIP
  Result (*host_alloc)(void**, size_t, unsigned) = nullptr;
  Result (*host_device_pointer)(void**, void*, unsigned) = nullptr;
  Result (*host_free)(void*) = nullptr;
  Result (*event_query)(Handle) = nullptr;
  Result (*stream_is_capturing)(Handle, int*) = nullptr;  // optional
  // Tensor maps for bulk tensor copies (CUDA 12+; absent elsewhere).
  Result (*encode_tiled)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*,
                         const uint32_t*, const uint32_t*, int, int, int, int) = nullptr;
  Result (*encode_im2col)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*,
                          const int*, const int*, uint32_t, uint32_t, const uint32_t*, int, int,
                          int, int) = nullptr;
  mutable std::map<int, bool> gates_work;  // by device, once checked
  Result (*cu_error_string)(Result, const char**);  // CUDA
  const char* (*hip_error_string)(Result);         // HIP
  mutable std::mutex mu;
  mutable std::map<int, Handle> contexts;
  mutable std::map<int, DeviceInfo> registered;  // HIP: device facts given by Python
};

namespace {
// CUdevice_attribute values (stable parts of the CUDA driver ABI).
constexpr int kCuAttrSmCount = 16;
constexpr int kCuAttrCcMajor = 75;
constexpr int kCuAttrCcMinor = 76;
constexpr int kCuAttrSmemOptin = 97;
constexpr int kCuAttrL2Bytes = 38;
constexpr int kCuFuncAttrMaxDynamicSmem = 8;
}  // namespace

Driver::Driver(Platform platform) : platform_(platform) {
  auto api = std::make_unique<Api>();
  const bool cuda = platform == Platform::kCuda;
  api->lib = std::make_unique<DynamicLibrary>(
      cuda ? std::vector<std::string>{"libcuda.so.1", "libcuda.so"}
           : Candidates("JAXFUSE_HIP", {"libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"},
                        {"/opt/rocm/lib"}));
  if (!api->lib->loaded()) {
    throw std::runtime_error(std::string("jaxfuse: cannot load the ") +
                             (cuda ? "CUDA driver" : "HIP runtime") + "; tried:" +
                             api->lib->errors());
  }
  const DynamicLibrary& lib = *api->lib;
  Require(lib, cuda ? "cuInit" : "hipInit", &api->init);
  Require(lib, cuda ? "cuDeviceGet" : "hipDeviceGet", &api->device_get);
  Require(lib, cuda ? "cuDeviceGetAttribute" : "hipDeviceGetAttribute", &api->device_attribute);
  Require(lib, cuda ? "cuDeviceGetName" : "hipDeviceGetName", &api->device_name);
  Require(lib, cuda ? "cuDevicePrimaryCtxRetain" : "hipDevicePrimaryCtxRetain",
          &api->primary_ctx_retain);
  Require(lib, cuda ? "cuCtxPushCurrent_v2" : "hipCtxPushCurrent", &api->ctx_push);
  Require(lib, cuda ? "cuCtxPopCurrent_v2" : "hipCtxPopCurrent", &api->ctx_pop);
  Require(lib, cuda ? "cuModuleLoadData" : "hipModuleLoadData", &api->module_load_data);
  Require(lib, cuda ? "cuModuleGetFunction" : "hipModuleGetFunction", &api->module_get_function);
  Require(lib, cuda ? "cuLaunchKernel" : "hipModuleLaunchKernel", &api->launch);
  Require(lib, cuda ? "cuMemsetD8Async" : "hipMemsetD8Async", &api->memset_d8_async);
  Require(lib, cuda ? "cuMemAlloc_v2" : "hipMalloc", &api->mem_alloc);
  Require(lib, cuda ? "cuMemFree_v2" : "hipFree", &api->mem_free);
  Require(lib, cuda ? "cuMemcpyHtoD_v2" : "hipMemcpyHtoD", &api->copy_htod);
  Require(lib, cuda ? "cuMemcpyDtoH_v2" : "hipMemcpyDtoH", &api->copy_dtoh);
  Require(lib, cuda ? "cuStreamCreate" : "hipStreamCreateWithFlags", &api->stream_create);
  Require(lib, cuda ? "cuStreamDestroy_v2" : "hipStreamDestroy", &api->stream_destroy);
  Require(lib, cuda ? "cuStreamSynchronize" : "hipStreamSynchronize", &api->stream_synchronize);
  Require(lib, cuda ? "cuEventCreate" : "hipEventCreateWithFlags", &api->event_create);
  Require(lib, cuda ? "cuEventRecord" : "hipEventRecord", &api->event_record);
  Require(lib, cuda ? "cuEventSynchronize" : "hipEventSynchronize", &api->event_synchronize);
  // CUDA 12.8 added cuEventElapsedTime_v2 and CUDA 13 headers name only it.
  if (!cuda || !lib.Get("cuEventElapsedTime_v2", &api->event_elapsed)) {
    Require(lib, cuda ? "cuEventElapsedTime" : "hipEventElapsedTime", &api->event_elapsed);
  }
  Require(lib, cuda ? "cuEventDestroy_v2" : "hipEventDestroy", &api->event_destroy);
  if (cuda) {
    Require(lib, "cuFuncSetAttribute", &api->func_set_attribute);
    Require(lib, "cuGetErrorString", &api->cu_error_string);
    if (!lib.Get("cuStreamWaitValue32_v2", &api->wait_value32)) api->wait_value32 = nullptr;
    if (!lib.Get("cuTensorMapEncodeTiled", &api->encode_tiled) ||
        !lib.Get("cuTensorMapEncodeIm2col", &api->encode_im2col)) {
      api->encode_tiled = nullptr, api->encode_im2col = nullptr;
    }
  } else {
    Require(lib, "hipGetErrorString", &api->hip_error_string);
    if (!lib.Get("hipStreamWaitValue32", &api->hip_wait_value32)) api->hip_wait_value32 = nullptr;
  }
  if (!lib.Get(cuda ? "cuMemHostAlloc" : "hipHostMalloc", &api->host_alloc) ||
      !lib.Get(cuda ? "cuMemHostGetDevicePointer_v2" : "hipHostGetDevicePointer",
               &api->host_device_pointer) ||
      !lib.Get(cuda ? "cuMemFreeHost" : "hipHostFree", &api->host_free) ||
      !lib.Get(cuda ? "cuEventQuery" : "hipEventQuery", &api->event_query)) {
    api->wait_value32 = nullptr, api->hip_wait_value32 = nullptr;
  }
  if (!lib.Get(cuda ? "cuStreamIsCapturing" : "hipStreamIsCapturing",
               &api->stream_is_capturing)) {
    api->stream_is_capturing = nullptr;
  }
  api_ = api.release();
  Check(api_->init(0), "initializing the GPU driver");
}

const Driver& Driver::Get(Platform platform) {
  static std::mutex mu;
  static auto* drivers = new std::map<Platform, const Driver*>();  // outlives static dtors
  std::lock_guard<std::mutex> lock(mu);
  auto it = drivers->find(platform);
  if (it == drivers->end()) it = drivers->emplace(platform, new Driver(platform)).first;
  return *it->second;
}

void Driver::Check(int status, const char* what) const {
  if (status == 0) return;
  const char* message = nullptr;
  if (api_->cu_error_string != nullptr) {
    api_->cu_error_string(status, &message);
  } else if (api_->hip_error_string != nullptr) {
    message = api_->hip_error_string(status);
  }
  throw std::runtime_error(std::string("jaxfuse: ") + what + " failed: " +
                           (message ? message : "error " + std::to_string(status)));
}

void* Driver::PrimaryContext(int ordinal) const {
  std::lock_guard<std::mutex> lock(api_->mu);
  auto it = api_->contexts.find(ordinal);
  if (it != api_->contexts.end()) return it->second;
  int device = 0;
  Check(api_->device_get(&device, ordinal), "looking up the device");
  Handle context = nullptr;
  // Retained once per device and never released: XLA shares this context.
  Check(api_->primary_ctx_retain(&context, device), "retaining the device's primary context");
  api_->contexts[ordinal] = context;
  return context;
}

std::string Driver::DeviceName(int ordinal) const {
  int device = 0;
  Check(api_->device_get(&device, ordinal), "looking up the device");
  char name[256] = {0};
  Check(api_->device_name(name, sizeof(name) - 1, device), "reading the device name");
  return name;
}

DeviceInfo Driver::Query(int ordinal) const {
  DeviceInfo info;
  int device = 0;
  Check(api_->device_get(&device, ordinal), "looking up the device");
  if (platform_ == Platform::kRocm) {
    // HIP's attribute numbering differs between releases; Python registers the facts.
    std::lock_guard<std::mutex> lock(api_->mu);
    auto it = api_->registered.find(ordinal);
    if (it == api_->registered.end()) {
      throw std::runtime_error("jaxfuse: ROCm device " + std::to_string(ordinal) +
                               " is not registered; compile a plan for it first");
    }
    return it->second;
  }
  int major = 0, minor = 0;
  Check(api_->device_attribute(&major, kCuAttrCcMajor, device), "reading the compute capability");
  Check(api_->device_attribute(&minor, kCuAttrCcMinor, device), "reading the compute capability");
  Check(api_->device_attribute(&info.sm_count, kCuAttrSmCount, device),
        "reading the multiprocessor count");
  Check(api_->device_attribute(&info.max_smem_per_block, kCuAttrSmemOptin, device),
        "reading the shared-memory limit");
  info.arch = "sm_" + std::to_string(major * 10 + minor);
  return info;
}

size_t Driver::L2Bytes(int ordinal) const {
  if (platform_ == Platform::kRocm) return 0;
  int device = 0, bytes = 0;
  Check(api_->device_get(&device, ordinal), "looking up the device");
  Check(api_->device_attribute(&bytes, kCuAttrL2Bytes, device), "reading the L2 size");
  return static_cast<size_t>(std::max(bytes, 0));
}

void Driver::Register(int ordinal, const DeviceInfo& info) const {
  std::lock_guard<std::mutex> lock(api_->mu);
  api_->registered[ordinal] = info;
}

std::vector<void*> Driver::Load(int ordinal, const std::string& binary,
                                const std::vector<EntryPoint>& entries) const {
  Handle context = PrimaryContext(ordinal);
  Check(api_->ctx_push(context), "activating the device's context");
  std::vector<void*> functions;
  try {
    Handle module = nullptr;  // kept loaded for the life of the process
    Check(api_->module_load_data(&module, binary.data()), "loading the compiled kernel");
    for (const EntryPoint& entry : entries) {
      Handle function = nullptr;
      Check(api_->module_get_function(&function, module, entry.name.c_str()),
            "finding the kernel entry point");
      if (entry.shared_bytes > 48 * 1024 && api_->func_set_attribute != nullptr) {
        Check(api_->func_set_attribute(function, kCuFuncAttrMaxDynamicSmem,
                                       static_cast<int>(entry.shared_bytes)),
              "raising the kernel's shared-memory limit");
      }
      functions.push_back(function);
    }
  } catch (...) {
    Handle ignored = nullptr;
    api_->ctx_pop(&ignored);
    throw;
  }
  Handle ignored = nullptr;
  api_->ctx_pop(&ignored);
  return functions;
}

// Makes the device's primary context current for a scope (host-side work outside XLA's).
class Driver::ContextScope {
 public:
  ContextScope(const Driver& driver, int ordinal) : driver_(driver) {
    driver_.Check(driver_.api_->ctx_push(driver_.PrimaryContext(ordinal)),
                  "activating the device's context");
  }
  ~ContextScope() {
    Handle ignored = nullptr;
    driver_.api_->ctx_pop(&ignored);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const Driver& driver_;
};

void* Driver::Allocate(int ordinal, size_t bytes) const {
  ContextScope scope(*this, ordinal);
  void* ptr = nullptr;
  Check(api_->mem_alloc(&ptr, std::max<size_t>(bytes, 16)), "allocating device memory");
  return ptr;
}

void Driver::Free(int ordinal, void* device_ptr) const {
  if (device_ptr == nullptr) return;
  ContextScope scope(*this, ordinal);
  api_->mem_free(device_ptr);
}

void Driver::CopyToDevice(int ordinal, void* dst, const void* src, size_t bytes) const {
  ContextScope scope(*this, ordinal);
  Check(api_->copy_htod(dst, src, bytes), "copying to the device");
}

void Driver::CopyToHost(int ordinal, void* dst, const void* src, size_t bytes) const {
  ContextScope scope(*this, ordinal);
  Check(api_->copy_dtoh(dst, src, bytes), "copying from the device");
}

void* Driver::CreateEvent(int ordinal) const {
  ContextScope scope(*this, ordinal);
  Handle event = nullptr;
  Check(api_->event_create(&event, 0), "creating an event");  // 0: timing enabled
  return event;
}

void Driver::DestroyEvent(int ordinal, void* event) const {
  if (event == nullptr) return;
  ContextScope scope(*this, ordinal);
  api_->event_destroy(event);
}

void Driver::RecordEvent(void* event, void* stream) const {
  Check(api_->event_record(event, stream), "recording an event");
}

double Driver::ElapsedMs(int ordinal, void* start, void* end) const {
  ContextScope scope(*this, ordinal);
  Check(api_->event_synchronize(end), "waiting for an event");
  float ms = 0;
  Check(api_->event_elapsed(&ms, start, end), "reading an event");
  return ms;
}

bool Driver::StreamGatesWork(int ordinal) const {
  {
    std::lock_guard<std::mutex> lock(api_->mu);
    auto it = api_->gates_work.find(ordinal);
    if (it != api_->gates_work.end()) return it->second;
  }
  bool works = false;
  if (api_->wait_value32 != nullptr || api_->hip_wait_value32 != nullptr) {
    // Hold a private stream on a fresh word, check that it is held, open it from the host and
    // check that it opens. A gate that never opens leaves that stream and word behind.
    void* word = nullptr;
    void* event = nullptr;
    void* stream = nullptr;
    try {
      void* device_word = nullptr;
      word = AllocateMappedHost(ordinal, &device_word);
      stream = CreateStream(ordinal);
      event = CreateEvent(ordinal);
      WaitValue(ordinal, stream, device_word, 1);
      RecordEvent(event, stream);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const bool held = !EventDone(event);
      __atomic_store_n(static_cast<volatile uint32_t*>(word), 1u, __ATOMIC_RELEASE);
      bool opened = false;
      for (int i = 0; i < 500 && !opened; ++i) {
        opened = EventDone(event);
        if (!opened) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      works = held && opened;
      if (opened) {
        DestroyEvent(ordinal, event);
        DestroyStream(ordinal, stream);
        FreeMappedHost(ordinal, word);
      }
    } catch (const std::exception&) {
      works = false;  // the resources of a failed check are left behind (tiny, once)
    }
  }
  std::lock_guard<std::mutex> lock(api_->mu);
  api_->gates_work[ordinal] = works;
  return works;
}

void* Driver::AllocateMappedHost(int ordinal, void** device_ptr) const {
  ContextScope scope(*this, ordinal);
  void* host = nullptr;
  // CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP (hipHostMallocPortable | Mapped).
  Check(api_->host_alloc(&host, 64, 0x1 | 0x2), "allocating mapped host memory");
  std::memset(host, 0, 64);
  if (int status = api_->host_device_pointer(device_ptr, host, 0); status != 0) {
    api_->host_free(host);
    Check(status, "mapping host memory into the device");
  }
  return host;
}

void Driver::FreeMappedHost(int ordinal, void* host_ptr) const {
  if (host_ptr == nullptr) return;
  ContextScope scope(*this, ordinal);
  api_->host_free(host_ptr);
}

bool Driver::EventDone(void* event) const { return api_->event_query(event) == 0; }

bool Driver::Capturing(int ordinal, void* stream) const {
  if (api_->stream_is_capturing == nullptr) return false;  // (drivers before graph capture)
  ContextScope scope(*this, ordinal);
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE / hipStreamCaptureStatusNone
  Check(api_->stream_is_capturing(stream, &status), "asking whether a stream is captured");
  return status != 0;
}

void Driver::WaitValue(int ordinal, void* stream, void* device_ptr, uint32_t value) const {
  ContextScope scope(*this, ordinal);
  // Flag 0: CU_STREAM_WAIT_VALUE_GEQ / hipStreamWaitValueGte.
  Check(api_->wait_value32 != nullptr
            ? api_->wait_value32(stream, device_ptr, value, 0)
            : api_->hip_wait_value32(stream, device_ptr, value, 0, 0xffffffffu),
        "holding a stream");
}

void* Driver::CreateStream(int ordinal) const {
  ContextScope scope(*this, ordinal);
  Handle stream = nullptr;
  Check(api_->stream_create(&stream, 1), "creating a stream");  // 1: non-blocking
  return stream;
}

void Driver::DestroyStream(int ordinal, void* stream) const {
  if (stream == nullptr) return;
  ContextScope scope(*this, ordinal);
  api_->stream_destroy(stream);
}

double Driver::TimeLaunches(int ordinal, void* function, const EntryPoint& entry,
                            const FusedParams& params, int repeats, void* flush,
                            size_t flush_bytes, size_t poison_bytes) const {
  ContextScope scope(*this, ordinal);
  Handle stream = nullptr;
  Check(api_->stream_create(&stream, 1), "creating a stream");  // 1: non-blocking
  std::vector<Handle> events(2 * repeats, nullptr);
  std::vector<double> times;
  // The timed launches are queued behind a closed gate and run back to back once it opens:
  // a kernel of a few microseconds otherwise ends before the host has queued the next one,
  // and its events time the host's launch work (every pointwise variant at batch 1 then
  // timed alike, and the choice among them was noise). A watchdog opens the gate if queuing
  // stalls: another thread's synchronizing driver call (a free, a module load) can wait for
  // this stream while holding what this thread's next launch needs.
  volatile uint32_t* gate = nullptr;
  std::promise<void> queued;
  std::thread watchdog;
  auto open_gate = [&] {
    if (gate == nullptr) return;
    __atomic_store_n(gate, 1u, __ATOMIC_RELEASE);
    if (watchdog.joinable()) {
      queued.set_value();
      watchdog.join();
    }
  };
  // One release on every way out, a throw included: the stream never left held.
  struct Release {
    std::function<void()> run;
    ~Release() { run(); }
  } release{[&] {
    open_gate();
    api_->stream_synchronize(stream);
    for (Handle e : events) if (e) api_->event_destroy(e);
    api_->stream_destroy(stream);
    FreeMappedHost(ordinal, const_cast<uint32_t*>(gate));
  }};
  for (Handle& e : events) Check(api_->event_create(&e, 0), "creating an event");
  if (poison_bytes > 0) {
    Check(api_->memset_d8_async(params.y, 0xff, poison_bytes, stream), "poisoning the output");
  }
  Launch(function, entry, stream, params);  // warm-up
  if (repeats > 1 && StreamGatesWork(ordinal)) {
    void* gate_device = nullptr;
    gate = static_cast<volatile uint32_t*>(AllocateMappedHost(ordinal, &gate_device));
    WaitValue(ordinal, stream, gate_device, 1);
    watchdog = std::thread([gate, done = queued.get_future()] {
      if (done.wait_for(std::chrono::milliseconds(20)) == std::future_status::timeout) {
        __atomic_store_n(gate, 1u, __ATOMIC_RELEASE);
      }
    });
  }
  for (int i = 0; i < repeats; ++i) {
    if (flush != nullptr) {
      Check(api_->memset_d8_async(flush, static_cast<unsigned char>(i), flush_bytes, stream),
            "flushing L2");
    }
    Check(api_->event_record(events[2 * i], stream), "recording an event");
    Launch(function, entry, stream, params);
    Check(api_->event_record(events[2 * i + 1], stream), "recording an event");
  }
  open_gate();
  Check(api_->stream_synchronize(stream), "waiting for the timed launches");
  for (int i = 0; i < repeats; ++i) {
    float ms = 0;
    Check(api_->event_elapsed(&ms, events[2 * i], events[2 * i + 1]), "reading an event");
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void Driver::Memset(void* device_ptr, unsigned char value, size_t bytes, void* stream) const {
  Check(api_->memset_d8_async(device_ptr, value, bytes, stream), "poisoning the output");
}

void Driver::EncodeTensorMap(const TensorMapSpec& spec, const void* address,
                             TensorMap* map) const {
  if (api_->encode_tiled == nullptr || api_->encode_im2col == nullptr) {
    throw std::runtime_error("jaxfuse: this driver cannot encode tensor maps (CUDA 12+ needed)");
  }
  // Interleave none, the spec's swizzle, 128-byte L2 promotion, zeros outside the tensor.
  constexpr int kInterleaveNone = 0, kL2Promote128 = 2, kFillZeros = 0;
  void* global = const_cast<void*>(address);
  const int status =
      spec.im2col
          ? api_->encode_im2col(map, spec.data_type, spec.rank, global, spec.dims, spec.strides,
                                spec.lower, spec.upper, spec.channels, spec.pixels,
                                spec.element_strides, kInterleaveNone, spec.swizzle,
                                kL2Promote128, kFillZeros)
          : api_->encode_tiled(map, spec.data_type, spec.rank, global, spec.dims, spec.strides,
                               spec.box, spec.element_strides, kInterleaveNone, spec.swizzle,
                               kL2Promote128, kFillZeros);
  Check(status, spec.im2col    ? "encoding the input's im2col tensor map"
                : spec.filters ? "encoding the filters' tensor map"
                               : "encoding the input's tiled tensor map");
}

namespace {

bool SameMap(const TensorMapSpec& a, const TensorMapSpec& b) {
  return a.filters == b.filters && a.im2col == b.im2col && a.data_type == b.data_type &&
         a.swizzle == b.swizzle &&
         a.rank == b.rank && a.channels == b.channels && a.pixels == b.pixels &&
         std::equal(a.dims, a.dims + 5, b.dims) && std::equal(a.strides, a.strides + 4, b.strides) &&
         std::equal(a.box, a.box + 5, b.box) &&
         std::equal(a.element_strides, a.element_strides + 5, b.element_strides) &&
         std::equal(a.lower, a.lower + 2, b.lower) && std::equal(a.upper, a.upper + 2, b.upper);
}

}  // namespace

const TensorMap& Driver::CachedTensorMap(const TensorMapSpec& spec, const void* address) const {
  // The maps last encoded on this thread, by buffer address: XLA hands a program the same
  // buffers call after call, so most launches skip encoding. Per thread: no lock. (Where the
  // buffers move on every call, encoding is cheap beside the rest of an update: 17 maps a
  // call for 2.6 us in a batch-1 ResNet-50 whose command-buffer update took 158-635 us under
  // the profiler; H100, 2026-11-27.)
  struct Entry {
    TensorMapSpec spec;
    const void* address = nullptr;
    TensorMap map;
  };
  constexpr size_t kSlots = 64;
  thread_local Entry slots[kSlots];
  const size_t slot = (reinterpret_cast<uintptr_t>(address) / 256 + spec.dims[0] * 31 +
                       spec.dims[1] * 7 + spec.filters) % kSlots;
  Entry& entry = slots[slot];
  if (entry.address != address || !SameMap(entry.spec, spec)) {
    entry.address = nullptr;  // invalid until encoded (the encoding may throw)
    const auto start = std::chrono::steady_clock::now();
    EncodeTensorMap(spec, address, &entry.map);
    CountTensorMapEncode(std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - start).count());
    entry.spec = spec, entry.address = address;
  }
  return entry.map;
}

const void* Driver::ParamBlock(const EntryPoint& entry, const FusedParams& params,
                               TmaParams* tma, size_t* bytes) const {
  if (entry.tensor_maps.empty()) {
    *bytes = sizeof(FusedParams);
    return &params;
  }
  // Maps hold the buffers' addresses: encoded for these buffers (the input's, and the
  // filters' unless the kernel reads them itself).
  *tma = TmaParams{};
  tma->x = CachedTensorMap(entry.tensor_maps[0], params.x);
  if (entry.tensor_maps.size() > 1) tma->w = CachedTensorMap(entry.tensor_maps[1], params.w);
  tma->p = params;
  *bytes = sizeof(TmaParams);
  return tma;
}

void Driver::Launch(void* function, const EntryPoint& entry, void* stream,
                    const FusedParams& params) const {
  TmaParams tma;  // (filled only for entries with tensor maps)
  size_t bytes = 0;
  LaunchBlock(function, entry.grid, entry.block, entry.shared_bytes, stream,
              ParamBlock(entry, params, &tma, &bytes));
}
void Driver::LaunchBlock(void* function, unsigned grid, unsigned block, unsigned shared_bytes,
                         void* stream, const void* params) const {
  void* args[] = {const_cast<void*>(params)};  // the driver copies the block when enqueuing
  Check(api_->launch(function, grid, 1, 1, block, 1, 1, shared_bytes, stream, args, nullptr),
        "launching a kernel");
}

}  // namespace jaxfuse::gpu
