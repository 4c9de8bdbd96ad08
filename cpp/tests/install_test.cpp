// The run-time install of libgmlake_torch.so, on a machine without a GPU: loads the library
// with dlopen (as Python's ctypes does), checks the refusals (bad configuration, other torch
// version, other C++ ABI, a conflicting PYTORCH_CUDA_ALLOC_CONF backend), installs, and calls
// the allocator through torch's interface where no GPU is needed. With no CUDA driver, the
// first call that needs a device must throw a c10::Error, never crash.
//
// usage: gmlake_install_test <path to libgmlake_torch.so>
// (LD_LIBRARY_PATH must reach torch's lib/ and libcudart.)
#include <dlfcn.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "check.h"

using install_fn = int (*)(const char*);
using install_checked_fn = int (*)(const char*, const char*, int);
using int_fn = int (*)();
using str_fn = const char* (*)();
using json_fn = long long (*)(int, char*, size_t);

static bool contains(const std::string& s, const char* what) {
  return s.find(what) != std::string::npos;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <libgmlake_torch.so>\n", argv[0]);
    return 2;
  }
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) {
    std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
    return 1;
  }
  auto install = reinterpret_cast<install_fn>(dlsym(h, "gmlake_install"));
  auto install_checked = reinterpret_cast<install_checked_fn>(dlsym(h, "gmlake_install_checked"));
  auto is_installed = reinterpret_cast<int_fn>(dlsym(h, "gmlake_is_installed"));
  auto last_error = reinterpret_cast<str_fn>(dlsym(h, "gmlake_last_error"));
  auto build_info = reinterpret_cast<str_fn>(dlsym(h, "gmlake_build_info"));
  auto check_conf = reinterpret_cast<install_fn>(dlsym(h, "gmlake_check_conf"));
  auto device_count = reinterpret_cast<int_fn>(dlsym(h, "gmlake_device_count"));
  auto stats_json = reinterpret_cast<json_fn>(dlsym(h, "gmlake_stats_json"));
  if (!install || !install_checked || !is_installed || !last_error || !build_info || !check_conf ||
      !device_count || !stats_json) {
    std::fprintf(stderr, "missing exported symbols\n");
    return 1;
  }
  std::printf("build info: %s\n", build_info());

  // Refusals.
  CHECK(check_conf("fragLimit:lots") != 0, "invalid conf accepted");
  CHECK(contains(last_error(), "fragLimit") && contains(last_error(), "lots"), "%s", last_error());
  CHECK(install_checked("", "2.10.1+cu128", 1) != 0, "other torch version accepted");
  CHECK(contains(last_error(), "2.10.1"), "%s", last_error());
  CHECK(install_checked("", "2.11.0+cu130", 0) != 0, "other ABI accepted");
  CHECK(contains(last_error(), "ABI"), "%s", last_error());
  setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,backend:native", 1);
  CHECK(install("") != 0, "conflicting backend accepted");
  CHECK(contains(last_error(), "backend"), "%s", last_error());
  unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  CHECK(install("nonsense:1") != 0, "unknown key accepted");
  CHECK(contains(last_error(), "nonsense"), "%s", last_error());
  CHECK(is_installed() == 0, "installed after refusals");

  namespace cca = c10::cuda::CUDACachingAllocator;
  CHECK(cca::get()->name() == "native", "torch's allocator is %s", cca::get()->name().c_str());

  // Install (the running torch's version is read from torch/version.py beside libc10_cuda).
  CHECK(install("fragLimit:1MiB") == 0, "install failed: %s", last_error());
  CHECK(is_installed() == 1, "not installed");
  CHECK(cca::get()->name() == "gmlake", "torch's allocator is %s", cca::get()->name().c_str());
  CHECK(c10::GetAllocator(c10::DeviceType::CUDA) == cca::get(), "c10::GetAllocator(CUDA) is not gmlake");
  CHECK(install("fragLimit:1MiB") == 0, "a repeated install with the same conf must succeed");
  CHECK(install("fragLimit:2MiB") != 0, "the configuration changed after install");

  // torch's lazy CUDA init calls init(device_count); nothing touches a device yet.
  cca::CUDAAllocator* a = cca::get();
  CHECK(!a->initialized(), "initialized before init");
  a->init(2);
  CHECK(a->initialized(), "not initialized after init");
  CHECK(device_count() == 2, "device count %d", device_count());
  auto stats = a->getDeviceStats(1);
  CHECK(stats.allocated_bytes[0].current == 0, "stats of an unused device");
  // An unused device has every key, at zero (readers need not wait for the first allocation).
  const long long n_json = stats_json(0, nullptr, 0);
  std::string json(n_json > 0 ? static_cast<size_t>(n_json) + 1 : 1, '\0');
  CHECK(stats_json(0, json.data(), json.size()) == n_json && contains(json, "\"gmlake.stitches\":0") &&
            contains(json, "\"gmlake.ipc_imports\":0") &&
            contains(json, "\"gmlake.initialized\":0"),
        "stats json of an unused device: %s", json.c_str());
  CHECK(stats_json(5, nullptr, 0) < 0, "stats json of a device out of range");
  auto snap = a->snapshot({0, 0}, true);
  CHECK(snap.segments.empty(), "segments before any allocation");
  CHECK(snap.device_traces.size() == 2, "device traces %zu", snap.device_traces.size());
  CHECK(
      contains(snap.config_metadata.last_allocator_settings, "backend:gmlake") &&
          contains(snap.config_metadata.last_allocator_settings, "fragLimit:1048576"),
      "settings: %s",
      snap.config_metadata.last_allocator_settings.c_str());
  a->recordHistory(true, nullptr, 100, cca::RecordContext::NEVER, false, {});
  CHECK(a->isHistoryEnabled(), "history");
  a->recordHistory(false, nullptr, 0, cca::RecordContext::NEVER, true, {"alloc"});
  CHECK(a->name() == "gmlake", "name");
  CHECK(a->getExpandableSegmentSizes(0).empty(), "expandable segments");

  // Bad input fails with clear errors: sharing what gmlake did not allocate, opening
  // malformed IPC handles.
  try {
    a->shareIpcHandle(nullptr);
    CHECK(false, "shareIpcHandle did not throw");
  } catch (const c10::Error& e) {
    CHECK(contains(e.what(), "was not allocated by gmlake"), "%s", e.what());
  }
  for (const std::string& bad : {std::string(), std::string("\x01e"), std::string("\x02q"),
                                 std::string("\x02e\x01\x02")}) {
    try {
      a->getIpcDevPtr(bad);
      CHECK(false, "getIpcDevPtr accepted a malformed handle of %zu bytes", bad.size());
    } catch (const c10::Error& e) {
      CHECK(contains(e.what(), "invalid CUDA IPC handle"), "%s", e.what());
    }
  }
  try {
    a->setCheckpointPoolState(0, nullptr);
    CHECK(false, "setCheckpointPoolState accepted a null state");
  } catch (const c10::Error& e) {
    CHECK(contains(e.what(), "gmlake"), "%s", e.what());
  }

  // Foreign pointers are tolerated.
  int local = 0;
  a->raw_delete(&local);
  size_t size = 123;
  CHECK(a->getBaseAllocation(&local, &size) == &local && size == 0, "base allocation of a foreign pointer");

  // No driver here: the first call that needs a device throws, with the reason.
  try {
    (void)a->getMemoryFraction(0);
    std::printf("note: a CUDA device was usable here\n");
  } catch (const c10::Error& e) {
    CHECK(contains(e.what(), "gmlake"), "%s", e.what());
    std::printf("no device (as expected here): %s\n", std::string(e.what()).substr(0, 200).c_str());
  }

  if (failures == 0) {
    std::printf("gmlake_install_test: ok\n");
    return 0;
  }
  std::printf("gmlake_install_test: %d failure(s)\n", failures);
  return 1;
}
