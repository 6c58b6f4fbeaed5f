// The Python extension: FFI handler capsules for jax.ffi.register_ffi_target, and the host-side
// entry points plan.compile(), the tests and `python -m jaxfuse info` use.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>

#include "cpu/fused_cpu.h"
#include "cpu/thread_pool.h"
#include "ffi/handlers.h"
#include "ffi/plan_registry.h"
#include "gpu/autotune.h"
#include "gpu/backend.h"
#include "gpu/convert_many.h"
#include "gpu/embedded_sources.h"
#include "gpu/kernel_cache.h"
#include "gpu/stopwatch.h"

namespace nb = nanobind;
using jaxfuse::gpu::Platform;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

Platform ParsePlatform(std::string_view name) {
  if (name == "CUDA" || name == "cuda") return Platform::kCuda;
  if (name == "ROCM" || name == "rocm") return Platform::kRocm;
  throw std::invalid_argument("jaxfuse: unknown GPU platform '" + std::string(name) + "'");
}

nb::dict Describe(const jaxfuse::gpu::GeneratedKernel& generated) {
  nb::dict out;
  out["solver"] = generated.solver;
  out["tile"] = generated.tile;
  nb::list entries;
  for (const auto& e : generated.entries) {
    nb::dict entry;
    entry["name"] = e.name;
    entry["grid"] = e.grid;
    entry["block"] = e.block;
    entry["shared_bytes"] = e.shared_bytes;
    entry["alignment"] = e.alignment;
    entries.append(entry);
  }
  out["entries"] = entries;
  return out;
}

}  // namespace

NB_MODULE(_jaxfuse_ext, m) {
  m.doc() = "jaxfuse's C++ core: XLA FFI handlers for fused conv/bias/batchnorm/activation.";

  m.def("ffi_handlers", [] {
    nb::dict handlers, cuda, rocm;
    handlers["cpu"] = Capsule(jaxfuse::kFusedChainCpu);
    cuda["instantiate"] = Capsule(jaxfuse::kFusedChainGpuInstantiate);
    rocm["instantiate"] = Capsule(jaxfuse::kFusedChainGpuInstantiate);
    cuda["initialize"] = Capsule(jaxfuse::kFusedChainCudaInitialize);
    cuda["execute"] = Capsule(jaxfuse::kFusedChainCuda);
    rocm["initialize"] = Capsule(jaxfuse::kFusedChainRocmInitialize);
    rocm["execute"] = Capsule(jaxfuse::kFusedChainRocm);
    handlers["CUDA"] = cuda;
    handlers["ROCM"] = rocm;
    return handlers;
  }, "FFI handlers by platform name (a capsule, or a dict of capsules by FFI stage).");

  // The record stage's own registration (ffi/record_registration.cc), where these FFI
  // headers have the stage.
#ifdef JAXFUSE_FFI_RECORD
  m.def("ffi_api_probe", [] { return Capsule(jaxfuse::kFfiApiProbeCuda); },
        "The CUDA probe target's handler: it keeps the FFI API XLA calls it with.");
  m.def("register_cuda_record", [](const std::string& name) -> std::tuple<std::string, std::string> {
    const char* why = "";
    switch (jaxfuse::RegisterCudaRecordBundle(name.c_str(), &why)) {
      case jaxfuse::RecordRegistration::kDone: return {"done", ""};
      case jaxfuse::RecordRegistration::kNoApiYet: return {"no api yet", why};
      default: return {"refused", why};
    }
  }, nb::arg("name"),
        "Registers the fused chain's CUDA bundle, record stage included, under `name` through "
        "the API the probe received: (\"done\" | \"no api yet\" | \"refused\", why not).");
#endif

  m.def("ffi_types", [] {
    auto registration = [](XLA_FFI_TypeId* id, const XLA_FFI_TypeInfo* info) {
      nb::dict out;
      out["type_id"] = nb::capsule(static_cast<void*>(id));
      out["type_info"] = nb::capsule(const_cast<void*>(static_cast<const void*>(info)));
      return out;
    };
    nb::dict types;
    types["CUDA"] = registration(jaxfuse::GpuPlanStateTypeId(), jaxfuse::GpuPlanStateTypeInfo());
    types["ROCM"] = registration(jaxfuse::GpuPlanStateTypeId(), jaxfuse::GpuPlanStateTypeInfo());
    return types;
  }, "The fused chain's FFI state type per GPU platform, for jax.ffi.register_ffi_type.");

  m.def("convert_handlers", [] {
    nb::dict handlers, cuda, rocm;
    cuda["initialize"] = Capsule(jaxfuse::kConvertManyCudaInitialize);
    cuda["execute"] = Capsule(jaxfuse::kConvertManyCuda);
    rocm["initialize"] = Capsule(jaxfuse::kConvertManyRocmInitialize);
    rocm["execute"] = Capsule(jaxfuse::kConvertManyRocm);
    handlers["CUDA"] = cuda;
    handlers["ROCM"] = rocm;
    return handlers;
  }, "The batched conversion's FFI handlers by GPU platform (dicts of capsules by FFI stage).");

  m.def("convert_tables", [](const std::vector<std::tuple<uint64_t, uint64_t, int64_t, int, int>>&
                                 requests) {
    std::vector<jaxfuse::gpu::ConvertRequest> decoded;
    for (const auto& [src, dst, elements, src_code, dst_code] : requests) {
      decoded.push_back({reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst),
                         elements, src_code, dst_code});
    }
    nb::list tables;
    jaxfuse::gpu::ForEachConvertTable(
        decoded.data(), static_cast<int>(decoded.size()), [&](const jaxfuse::ConvertTable& t) {
          nb::list segments;
          for (int i = 0; i < t.count; ++i) {
            const jaxfuse::ConvertSegment& s = t.segments[i];
            segments.append(nb::make_tuple(reinterpret_cast<uint64_t>(s.src),
                                           reinterpret_cast<uint64_t>(s.dst), s.elements,
                                           s.first, s.codes));
          }
          tables.append(nb::make_tuple(t.items, segments));
        });
    return tables;
  }, nb::arg("requests"),
     "The launches of one batched conversion (for tests): per launch (items, segments), each\n"
     "segment (src, dst, elements, first item, codes), from (src, dst, elements, src code,\n"
     "dst code) requests with fake addresses.");

  m.def("gpu_compile_convert", [](std::string_view platform, const std::string& arch) {
    std::string binary;
    {
      nb::gil_scoped_release release;
      binary = jaxfuse::gpu::CompileConvertOnly(ParsePlatform(platform), arch);
    }
    nb::dict out;
    out["binary_bytes"] = binary.size();
    out["source"] = jaxfuse::gpu::ConvertSource();
    out["table_bytes"] = sizeof(jaxfuse::ConvertTable);
    out["max_segments"] = jaxfuse::kMaxConvertSegments;
    return out;
  }, nb::arg("platform"), nb::arg("arch"),
     "Compiles the batched conversion's kernel for an architecture without a device.");

  m.def("gpu_prepare_convert", [](std::string_view platform, int ordinal) {
    const Platform p = ParsePlatform(platform);
    std::shared_ptr<const jaxfuse::gpu::ConvertKernel> kernel;
    {
      nb::gil_scoped_release release;
      kernel = jaxfuse::gpu::GetConvertKernel(p, ordinal);
    }
    nb::dict out;
    out["arch"] = kernel->arch;
    out["origin"] = kernel->origin;
    return out;
  }, nb::arg("platform"), nb::arg("ordinal"),
     "Compiles (or finds in the disk cache) and loads the batched conversion's kernel.");

  m.def("stopwatch_handler", [] { return Capsule(jaxfuse::kStopwatchGpu); },
        "The 'jaxfuse_stopwatch' custom call's handler (CUDA and ROCM).");
  m.def("stopwatch_new", [](std::string_view platform, int ordinal) {
    return jaxfuse::gpu::NewStopwatch(ParsePlatform(platform), ordinal);
  }, nb::arg("platform"), nb::arg("ordinal"), "A new device stopwatch's id.");
  m.def("stopwatch_read", [](int64_t id) {
    jaxfuse::gpu::StopwatchReading reading;
    {
      nb::gil_scoped_release release;  // waits for the device
      reading = jaxfuse::gpu::ReadStopwatch(id);
    }
    return nb::make_tuple(reading.device_ms, reading.host_ms, reading.gated,
                          reading.gate_timed_out);
  }, nb::arg("id"),
        "(device ms, host ms, gated, gate timed out) between the stopwatch's last marks "
        "(waits for the end).");
  m.def("stopwatch_gate", &jaxfuse::gpu::SetStopwatchGate, nb::arg("id"), nb::arg("enabled"),
        "Whether the stopwatch's start mark holds the device until its end mark.");
  m.def("stopwatch_delete", &jaxfuse::gpu::DeleteStopwatch, nb::arg("id"));

  m.def("cpu_prepare", [](std::string_view plan) {
    // Parses and validates once; raises ValueError if malformed.
    const auto spec = jaxfuse::LookupPlan(plan);
    if (const char* refused = jaxfuse::cpu::Refuses(*spec)) throw std::invalid_argument(refused);
    return std::string(jaxfuse::cpu::SolverName(*spec));
  }, nb::arg("plan"), "Validates a plan signature for the CPU backend; the code that runs it.");

  m.def("plan_canonical", [](std::string_view plan) {
    return jaxfuse::LookupPlan(plan)->canonical;
  }, nb::arg("plan"),
     "The plan's canonical form (what cache keys and generated kernels use); raises ValueError\n"
     "if it is malformed.");

  m.def("cpu_threads", &jaxfuse::cpu::NumThreads, "Threads the CPU kernels use.");

  m.def("gpu_configure", [](const std::string& cache_dir,
                            const std::vector<std::string>& compiler_paths,
                            const std::string& cache_off_reason) {
    jaxfuse::gpu::DiskCache::Global().Configure(cache_dir, cache_off_reason);
    jaxfuse::gpu::SetCompilerSearchPaths(compiler_paths);
  }, nb::arg("cache_dir"), nb::arg("compiler_paths"), nb::arg("cache_off_reason") = "",
     "Sets the kernel cache directory ('' = memory only, for `cache_off_reason` if given) and\n"
     "extra runtime-compiler paths.");

  m.def("gpu_prepare", [](std::string_view platform, std::string_view plan, int ordinal) {
    const Platform p = ParsePlatform(platform);
    nb::gil_scoped_release release;  // compiling takes a while; let other threads run
    auto kernel = jaxfuse::gpu::GetKernel(p, *jaxfuse::LookupPlan(plan), ordinal);
    nb::gil_scoped_acquire acquire;
    nb::dict out = Describe(kernel->generated);
    out["arch"] = kernel->arch;
    out["origin"] = kernel->origin;
    out["variant"] = kernel->variant;
    return out;
  }, nb::arg("platform"), nb::arg("plan"), nb::arg("ordinal"),
     "Compiles (or finds in the caches) and loads the plan's kernel on a GPU device.");

  m.def("gpu_register_device", [](std::string_view platform, int ordinal, const std::string& arch,
                                  int sm_count, int max_smem_per_block) {
    jaxfuse::gpu::DeviceInfo info;
    info.arch = arch;
    info.sm_count = sm_count;
    info.max_smem_per_block = max_smem_per_block;
    info.hip = ParsePlatform(platform) == Platform::kRocm;
    jaxfuse::gpu::Driver::Get(ParsePlatform(platform)).Register(ordinal, info);
  }, nb::arg("platform"), nb::arg("ordinal"), nb::arg("arch"), nb::arg("sm_count"),
     nb::arg("max_smem_per_block"), "Records a device's facts (needed on ROCm).");

  m.def("gpu_compile_only", [](std::string_view platform, std::string_view plan,
                               const std::string& arch, int sm_count, int variant) {
    jaxfuse::gpu::DeviceInfo device;
    device.arch = arch;
    device.sm_count = sm_count;
    device.hip = ParsePlatform(platform) == Platform::kRocm;
    device.max_smem_per_block = device.hip ? 64 * 1024 : 227 * 1024;
    jaxfuse::gpu::GeneratedKernel generated;
    std::string binary;
    {
      nb::gil_scoped_release release;
      binary = jaxfuse::gpu::CompileOnly(ParsePlatform(platform), *jaxfuse::LookupPlan(plan),
                                         device, variant, &generated);
    }
    nb::dict out = Describe(generated);
    out["binary_bytes"] = binary.size();
    out["source"] = generated.source;
    out["variants"] = jaxfuse::gpu::CountVariants(*jaxfuse::LookupPlan(plan), device);
    return out;
  }, nb::arg("platform"), nb::arg("plan"), nb::arg("arch"), nb::arg("sm_count") = 132,
     nb::arg("variant") = 0,
     "Compiles one variant of a plan's kernel for an architecture without a device.");

  m.def("gpu_compiler", [](std::string_view platform) {
    const auto& compiler = jaxfuse::gpu::RuntimeCompiler::Get(ParsePlatform(platform));
    nb::dict out;
    out["version"] = compiler.version();
    out["library"] = compiler.library();
    return out;
  }, nb::arg("platform"), "The runtime compiler's version and path (raises if missing).");

  m.def("gpu_device_name", [](std::string_view platform, int ordinal) {
    return jaxfuse::gpu::Driver::Get(ParsePlatform(platform)).DeviceName(ordinal);
  }, nb::arg("platform"), nb::arg("ordinal"));

  m.def("gpu_l2_bytes", [](std::string_view platform, int ordinal) {
    return jaxfuse::gpu::Driver::Get(ParsePlatform(platform)).L2Bytes(ordinal);
  }, nb::arg("platform"), nb::arg("ordinal"),
     "The device's L2 cache in bytes (0 where it cannot be read).");

  m.def("gpu_cache", [](bool keys) {
    auto& disk = jaxfuse::gpu::DiskCache::Global();
    nb::dict out;
    out["directory"] = disk.directory();
    out["problem"] = disk.problem();
    nb::list key_list;
    if (keys) {
      for (const std::string& key : disk.Keys()) key_list.append(key);
    }
    out["keys"] = key_list;
    return out;
  }, nb::arg("keys") = true,
     "The disk kernel cache: directory, why it is off (if it is), and (reading every entry,\n"
     "unless keys=False) the keys it holds.");

  // A disk cache of its own, for tests of the cache on machines without a GPU; the backend
  // uses only the global one (gpu_configure).
  nb::class_<jaxfuse::gpu::DiskCache>(m, "_DiskCache")
      .def(nb::init<>())
      .def("configure", &jaxfuse::gpu::DiskCache::Configure, nb::arg("directory"),
           nb::arg("why_off") = "")
      .def_prop_ro("problem", &jaxfuse::gpu::DiskCache::problem)
      .def("load", [](jaxfuse::gpu::DiskCache& cache, const std::string& key) -> nb::object {
        std::string binary;
        bool hit;
        {
          nb::gil_scoped_release release;
          hit = cache.Load(key, &binary);
        }
        if (!hit) return nb::none();
        return nb::bytes(binary.data(), binary.size());
      }, nb::arg("key"), "The verified entry for `key`, or None.")
      .def("store", [](jaxfuse::gpu::DiskCache& cache, const std::string& key, nb::bytes data) {
        std::string binary(static_cast<const char*>(data.data()), data.size());
        nb::gil_scoped_release release;
        cache.Store(key, binary);
      }, nb::arg("key"), nb::arg("data"))
      .def("keys", &jaxfuse::gpu::DiskCache::Keys);

  // The process's disk cache (the GPU kernels' own), for small records such as the solver
  // chooser's decisions: the same directory checks and per-entry verification apply.
  m.def("cache_load", [](const std::string& key) -> nb::object {
    std::string value;
    bool hit;
    {
      nb::gil_scoped_release release;
      hit = jaxfuse::gpu::DiskCache::Global().Load(key, &value);
    }
    if (!hit) return nb::none();
    return nb::bytes(value.data(), value.size());
  }, nb::arg("key"), "The verified disk-cache entry for `key`, or None.");
  m.def("cache_store", [](const std::string& key, nb::bytes data) {
    std::string value(static_cast<const char*>(data.data()), data.size());
    nb::gil_scoped_release release;
    jaxfuse::gpu::DiskCache::Global().Store(key, value);
  }, nb::arg("key"), nb::arg("data"), "Stores `data` in the disk cache under `key`.");

  // The device-timing lock (gpu/autotune.h), so that Python measurements and the variant
  // autotuner never time at once. Acquire and release from the same thread.
  m.def("timing_acquire", [] {
    nb::gil_scoped_release release;  // the holder may need the GIL to finish
    jaxfuse::gpu::DeviceTimingMutex().lock();
  });
  m.def("timing_release", [] { jaxfuse::gpu::DeviceTimingMutex().unlock(); });
  m.def("timing_waited", &jaxfuse::gpu::ThreadTimingWaitSeconds,
        "Seconds the kernel autotuner has waited for the device-timing lock on this thread.");

  m.def("gpu_stats", [] {
    const auto s = jaxfuse::gpu::Stats();
    nb::dict out;
    out["compilations"] = s.compilations;
    out["disk_hits"] = s.disk_hits;
    out["loads"] = s.loads;
    out["tunings"] = s.tunings;
    out["records"] = s.records;
    out["record_updates"] = s.record_updates;
    out["record_update_ns"] = s.record_update_ns;
    out["tensor_map_encodes"] = s.tensor_map_encodes;
    out["tensor_map_encode_ns"] = s.tensor_map_encode_ns;
    return out;
  }, "Counts of kernel compilations, disk-cache hits, device loads, command-buffer records and "
     "tensor-map encodings in this process, with the host time of record updates and "
     "encodings.");

  m.def("wgmma_function", &jaxfuse::gpu::WgmmaFunction, nb::arg("n"), nb::arg("dtype"),
        nb::arg("b_mn_major"), "The generated wgmma wrapper for one tile width (for probes).");

  m.def("kernel_sources", [] {
    nb::dict sources;
    for (int i = 0; i < jaxfuse::kNumEmbeddedSources; ++i) {
      sources[jaxfuse::kEmbeddedSources[i].name] = jaxfuse::kEmbeddedSources[i].text;
    }
    return sources;
  }, "The embedded portable kernel sources, by file name.");
}
