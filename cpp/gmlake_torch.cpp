// libgmlake_torch.so: the run-time install of gmlake into PyTorch and the C accessors Python
// reads with ctypes. No C++ exception crosses these extern "C" functions: every one catches
// everything and reports through its return value and gmlake_last_error().
#include <dlfcn.h>
#include <link.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>

#include "version_compat.h"

#define GMLAKE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

std::mutex g_mu; // guards the install state below
std::mutex g_error_mu; // guards g_last_error_global (taken with or without g_mu, never before it)
gmlake::GmlakeAllocator* g_allocator = nullptr; // the installed instance (leaked)
std::string g_conf;
std::string g_last_error_global;
thread_local std::string t_last_error;
thread_local std::string t_info;

int fail(const std::string& msg) {
  t_last_error = msg;
  try {
    std::lock_guard<std::mutex> g(g_error_mu);
    g_last_error_global = msg;
  } catch (...) {
  }
  return -1;
}

std::string trim(std::string s) {
  const char* ws = " \t\r\n";
  s.erase(0, s.find_first_not_of(ws));
  s.erase(s.find_last_not_of(ws) + 1);
  return s;
}

// "2.11.0+cu130" -> "2.11"; "" when it does not parse.
std::string major_minor(const std::string& v) {
  std::smatch m;
  static const std::regex re("^\\s*(\\d+)\\.(\\d+)");
  if (std::regex_search(v, m, re)) {
    return m[1].str() + "." + m[2].str();
  }
  return "";
}

std::string dir_of(const std::string& path) {
  auto pos = path.rfind('/');
  return pos == std::string::npos ? std::string(".") : path.substr(0, pos);
}

// The path of the loaded library containing `addr`.
std::string library_of(const void* addr) {
  Dl_info info{};
  if (dladdr(addr, &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return "";
}

// The path of the loaded libc10_cuda: the object holding torch's allocator pointer, or else
// the loaded object named libc10_cuda.so (an executable may hold a copy-relocated pointer).
std::string loaded_c10_cuda() {
  std::string lib = library_of(gmlake::compat::c10_cuda_anchor());
  if (lib.find("libc10_cuda") != std::string::npos) {
    return lib;
  }
  lib.clear();
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) -> int {
        const char* name = info->dlpi_name;
        if (name != nullptr) {
          std::string n(name);
          auto slash = n.rfind('/');
          std::string base = slash == std::string::npos ? n : n.substr(slash + 1);
          if (base.rfind("libc10_cuda.so", 0) == 0) {
            *static_cast<std::string*>(data) = n;
            return 1;
          }
        }
        return 0;
      },
      &lib);
  return lib;
}

// The running torch's version: torch/version.py beside the loaded libc10_cuda (torch/lib), or
// libtorch's build-version file. Empty when neither is found.
std::string running_torch_version(std::string* source) {
  const std::string lib = loaded_c10_cuda();
  if (lib.empty()) {
    return "";
  }
  const std::string torch_dir = dir_of(dir_of(lib));
  {
    std::ifstream f(torch_dir + "/version.py");
    std::string line;
    static const std::regex re("^__version__\\s*=\\s*['\"]([^'\"]+)['\"]");
    while (f && std::getline(f, line)) {
      std::smatch m;
      if (std::regex_search(line, m, re)) {
        *source = torch_dir + "/version.py";
        return m[1].str();
      }
    }
  }
  {
    std::ifstream f(torch_dir + "/build-version");
    std::string line;
    if (f && std::getline(f, line) && !trim(line).empty()) {
      *source = torch_dir + "/build-version";
      return trim(line);
    }
  }
  return "";
}

// 1 / 0: the C++ ABI of the loaded libc10; -1: unknown.
int running_cxx11_abi() {
  const std::string self = library_of(reinterpret_cast<const void*>(&running_cxx11_abi));
  if (self.empty()) {
    return -1;
  }
  // dlsym on our own handle searches our dependencies, libc10 among them.
  void* h = dlopen(self.c_str(), RTLD_NOLOAD | RTLD_LAZY);
  if (h == nullptr) {
    return -1;
  }
  int abi = -1;
  if (dlsym(h, gmlake::compat::kAbiProbeCxx11) != nullptr) {
    abi = 1;
  } else if (dlsym(h, gmlake::compat::kAbiProbeOld) != nullptr) {
    abi = 0;
  }
  dlclose(h);
  return abi;
}

// A "backend" key in PyTorch's allocator settings conflicts with any installed allocator
// (torch asserts that the configured backend is the current allocator's name).
std::string conflicting_alloc_conf() {
  for (const char* var : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    const char* v = std::getenv(var);
    if (v == nullptr) {
      continue;
    }
    std::stringstream ss(v);
    std::string item;
    while (std::getline(ss, item, ',')) {
      auto colon = item.find(':');
      if (colon != std::string::npos && trim(item.substr(0, colon)) == "backend") {
        return std::string(var) + "=" + v;
      }
    }
  }
  return "";
}

std::string build_info_json() {
  std::ostringstream o;
  o << "{\"torch_version\":\"" << TORCH_VERSION << "\",\"torch_minor\":\""
    << gmlake::compat::built_torch_minor() << "\",\"cxx11_abi\":" << GMLAKE_CXX11_ABI
    << ",\"cuda_backend\":" << (gmlake::ffi::has_cuda_backend() ? "true" : "false")
#ifdef CUDART_VERSION
    << ",\"cudart_version\":" << CUDART_VERSION
#endif
    << "}";
  return o.str();
}

int install(const char* conf_c, const char* torch_version, int cxx11_abi) {
  const std::string conf = conf_c != nullptr ? conf_c : "";
  std::lock_guard<std::mutex> g(g_mu);
  namespace cca = c10::cuda::CUDACachingAllocator;

  if (g_allocator != nullptr && cca::allocator.load() == g_allocator) {
    if (conf == g_conf) {
      return 0; // already installed, same configuration
    }
    return fail(
        "gmlake is already installed (configuration \"" + g_conf +
        "\"); its configuration cannot change after installation (asked: \"" + conf + "\")");
  }
  if (gmlake::compat::current_allocator_initialized()) {
    return fail(
        "gmlake cannot be installed: CUDA is already initialized in this process (the current "
        "CUDA allocator, \"" +
        gmlake::compat::current_allocator_name() +
        "\", has been used). Install gmlake before anything touches CUDA: call gmlake.enable() "
        "right after `import torch`, or start the program with `python -m gmlake script.py`.");
  }

  // The torch the library was built for must be the one running: the allocator interface
  // (a vtable) changes between minor versions, and nothing checks it at load time.
  const std::string built = gmlake::compat::built_torch_minor();
  std::string source = "the caller";
  std::string running = torch_version != nullptr ? torch_version : "";
  if (running.empty()) {
    running = running_torch_version(&source);
  }
  if (!running.empty()) {
    const std::string mm = major_minor(running);
    if (mm != built) {
      return fail(
          "gmlake cannot be installed: libgmlake_torch was built for torch " + std::string(TORCH_VERSION) +
          " but torch " + running + " is running (from " + source +
          "). Build gmlake against the running torch (scripts/build-torch-ext.sh or cmake with "
          "TORCH_DIR).");
    }
  } else {
    std::fprintf(
        stderr,
        "[gmlake] warning: could not determine the running torch's version; assuming %s as built\n",
        TORCH_VERSION);
  }
  int abi = cxx11_abi;
  const int detected = running_cxx11_abi();
  if (abi < 0) {
    abi = detected;
  }
  if (abi >= 0 && abi != GMLAKE_CXX11_ABI) {
    return fail(
        "gmlake cannot be installed: libgmlake_torch was built with _GLIBCXX_USE_CXX11_ABI=" +
        std::to_string(GMLAKE_CXX11_ABI) + " but the running torch uses " + std::to_string(abi) +
        ". Rebuild with the matching ABI.");
  }
  if (detected >= 0 && detected != GMLAKE_CXX11_ABI) {
    return fail(
        "gmlake cannot be installed: the loaded libc10 uses _GLIBCXX_USE_CXX11_ABI=" +
        std::to_string(detected) + ", the library was built with " + std::to_string(GMLAKE_CXX11_ABI));
  }

  const std::string conflict = conflicting_alloc_conf();
  if (!conflict.empty()) {
    return fail(
        "gmlake cannot be installed while a CUDA allocator backend is chosen in " + conflict +
        ": remove the backend: key (gmlake replaces the backend).");
  }

  // Check the configuration now (environment + conf), so a bad value fails here and not at
  // the first allocation.
  try {
    gmlake::ffi::check_conf(rust::Str(conf));
  } catch (const rust::Error& e) {
    return fail(e.what());
  }

  auto* a = new gmlake::GmlakeAllocator(conf); // leaked: lives as long as the process
  gmlake::compat::install(a);
  g_allocator = a;
  g_conf = conf;
  return 0;
}

template <typename F>
int guarded(F&& f) noexcept {
  try {
    return f();
  } catch (const std::exception& e) {
    return fail(std::string("gmlake: ") + e.what());
  } catch (...) {
    return fail("gmlake: unknown C++ exception");
  }
}

long long copy_out(const std::string& s, char* buf, size_t len) {
  if (buf != nullptr && len > s.size()) {
    std::memcpy(buf, s.data(), s.size());
    buf[s.size()] = '\0';
  }
  return static_cast<long long>(s.size());
}

gmlake::Impl* installed_impl() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_allocator != nullptr ? &g_allocator->impl() : nullptr;
}

} // namespace

// Installs gmlake as PyTorch's CUDA allocator. `conf`: gmlake settings as "key:value,..."
// (over GMLAKE_CONF and GMLake's variables). The running torch's version is read from
// torch/version.py beside the loaded libc10_cuda. 0 on success; -1 with gmlake_last_error().
GMLAKE_EXPORT int gmlake_install(const char* conf) {
  return guarded([&] { return install(conf, nullptr, -1); });
}

// As gmlake_install, with the running torch's version (torch.__version__) and C++ ABI
// (torch._C._GLIBCXX_USE_CXX11_ABI: 1/0, or -1 for unknown) given by the caller.
GMLAKE_EXPORT int gmlake_install_checked(const char* conf, const char* torch_version, int cxx11_abi) {
  return guarded([&] { return install(conf, torch_version, cxx11_abi); });
}

// 1 when gmlake is PyTorch's current CUDA allocator, else 0.
GMLAKE_EXPORT int gmlake_is_installed(void) {
  return guarded([&] {
    std::lock_guard<std::mutex> g(g_mu);
    return (g_allocator != nullptr &&
            c10::cuda::CUDACachingAllocator::allocator.load() == g_allocator)
        ? 1
        : 0;
  });
}

// Returns gmlake's cached memory to the device (torch.cuda.empty_cache() for programs that
// cannot call torch, e.g. tch). 0, or -1 with gmlake_last_error() when gmlake is not installed.
GMLAKE_EXPORT int gmlake_empty_cache(void) {
  return guarded([&] {
    gmlake::Impl* impl = installed_impl();
    if (impl == nullptr) {
      return fail("gmlake: empty_cache: gmlake is not installed");
    }
    impl->empty_cache({0, 0});
    return 0;
  });
}

// The name() of PyTorch's current CUDA allocator ("gmlake", "native", ...), whether or not
// this library installed it; copied into buf as a C string when it fits. Returns its length.
GMLAKE_EXPORT long long gmlake_active_backend(char* buf, size_t len) {
  try {
    return copy_out(gmlake::compat::current_allocator_name(), buf, len);
  } catch (const std::exception& e) {
    fail(std::string("gmlake: ") + e.what());
    return -1;
  } catch (...) {
    fail("gmlake: unknown C++ exception");
    return -1;
  }
}

// The last error of this thread (or of any thread, if this one has none). Valid until the
// next call from this thread.
GMLAKE_EXPORT const char* gmlake_last_error(void) {
  try {
    if (t_last_error.empty()) {
      std::lock_guard<std::mutex> g(g_error_mu);
      t_info = g_last_error_global;
      return t_info.c_str();
    }
    return t_last_error.c_str();
  } catch (...) {
    return "gmlake: error while reading the last error";
  }
}

// What the library was built against, as JSON. Valid until the next call from this thread.
GMLAKE_EXPORT const char* gmlake_build_info(void) {
  try {
    t_info = build_info_json();
    return t_info.c_str();
  } catch (...) {
    return "{}";
  }
}

// Checks a configuration (environment + conf) without installing. 0 if valid; -1 with the
// error (naming the key and the value) in gmlake_last_error().
GMLAKE_EXPORT int gmlake_check_conf(const char* conf) {
  return guarded([&] {
    try {
      gmlake::ffi::check_conf(rust::Str(conf != nullptr ? conf : ""));
    } catch (const rust::Error& e) {
      return fail(e.what());
    }
    return 0;
  });
}

// The effective configuration as "backend:gmlake,key:value,...". Returns its length; copies it
// with a terminating NUL when `len` exceeds the length. -1 on error.
GMLAKE_EXPORT long long gmlake_settings(char* buf, size_t len) {
  try {
    gmlake::Impl* impl = installed_impl();
    if (impl == nullptr) {
      return fail("gmlake is not installed");
    }
    return copy_out(impl->settings_string(), buf, len);
  } catch (const std::exception& e) {
    return fail(std::string("gmlake: ") + e.what());
  } catch (...) {
    return fail("gmlake: unknown C++ exception");
  }
}

// Memory debugging mode: checks the canaries of freed blocks whose copies completed (with
// `wait`, waits for every pending copy first: cudaEventSynchronize on each, never a device
// synchronisation) and returns the number of reports so far; -1 on error.
GMLAKE_EXPORT long long gmlake_debug_check(int wait) {
  try {
    gmlake::Impl* impl = installed_impl();
    if (impl == nullptr) {
      return fail("gmlake is not installed");
    }
    return static_cast<long long>(impl->debug_check(wait != 0));
  } catch (const std::exception& e) {
    return fail(std::string("gmlake: ") + e.what());
  } catch (...) {
    return fail("gmlake: unknown C++ exception");
  }
}

// The debug mode's reports as a JSON list (see gmlake.debug_report()); the bits of the mode
// (0: off) through gmlake_debug_mode. Same conventions as gmlake_settings.
GMLAKE_EXPORT long long gmlake_debug_reports_json(char* buf, size_t len) {
  try {
    gmlake::Impl* impl = installed_impl();
    if (impl == nullptr) {
      return fail("gmlake is not installed");
    }
    return copy_out(impl->debug_reports_json(), buf, len);
  } catch (const std::exception& e) {
    return fail(std::string("gmlake: ") + e.what());
  } catch (...) {
    return fail("gmlake: unknown C++ exception");
  }
}

GMLAKE_EXPORT int gmlake_debug_mode(void) {
  return guarded([&] {
    gmlake::Impl* impl = installed_impl();
    return impl != nullptr ? static_cast<int>(impl->debug_mode()) : 0;
  });
}

// Number of devices torch initialized the allocator for (0 before CUDA initializes).
GMLAKE_EXPORT int gmlake_device_count(void) {
  return guarded([&] {
    gmlake::Impl* impl = installed_impl();
    return impl != nullptr ? impl->device_count() : 0;
  });
}

// The statistics of `device` as a flat JSON object: torch.cuda.memory_stats()'s keys for the
// DeviceStats fields, plus "gmlake.*" counters (stitches, pages_stitched, cached/retired
// bytes, driver calls by kind, device total, page size). "{}" when the device's
// allocator does not exist yet. Returns the length; copies with a NUL when `len` exceeds it.
// -1 on error.
GMLAKE_EXPORT long long gmlake_stats_json(int device, char* buf, size_t len) {
  try {
    gmlake::Impl* impl = installed_impl();
    if (impl == nullptr) {
      return fail("gmlake is not installed");
    }
    return copy_out(impl->stats_json(device), buf, len);
  } catch (const std::exception& e) {
    return fail(std::string("gmlake: ") + e.what());
  } catch (...) {
    return fail("gmlake: unknown C++ exception");
  }
}

// gmlake's own view of `device`'s memory as JSON: segments with blocks, stitched flags, pages,
// page size and configuration. Same conventions as gmlake_stats_json.
GMLAKE_EXPORT long long gmlake_snapshot_json(int device, char* buf, size_t len) {
  try {
    gmlake::Impl* impl = installed_impl();
    if (impl == nullptr) {
      return fail("gmlake is not installed");
    }
    return copy_out(impl->snapshot_json(device), buf, len);
  } catch (const std::exception& e) {
    return fail(std::string("gmlake: ") + e.what());
  } catch (...) {
    return fail("gmlake: unknown C++ exception");
  }
}
