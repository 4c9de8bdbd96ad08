// Open CUDA IPC handles for gmlake::Impl (gmlake_impl.h): handle bytes -> the pointer handed
// out, as PyTorch's ipcMemHandle_to_devptr, so that the same handle opened twice gives the
// same pointer while the first is alive. Entries whose pointer died are erased by its deleter.
// mu_ guards the map only: no driver call is made while it is held. An entry being opened
// (`opening`) makes other openers of the same handle wait on cv_ (one opening per handle, as
// cudaIpcOpenMemHandle wants); openers of other handles and deleters go on.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace gmlake {

class OnceLog;

class IpcCache {
 public:
  // The pointer open for `key`, or the one `open` opens (then kept for `key`).
  std::shared_ptr<void> cached(const std::string& key, const std::function<std::shared_ptr<void>()>& open);
  // Called by a pointer's deleter: drops the entry of `key` unless it was opened again.
  void forget(const std::string& key);
  // A raw cudaIpcMemHandle_t (a cudaMalloc allocation of another process), opened on the
  // current device with cudaIpcOpenMemHandle and closed with the last shared_ptr.
  std::shared_ptr<void> open_cuda(const std::string& raw, OnceLog& log);

 private:
  struct Entry {
    std::weak_ptr<void> ptr;
    bool opening = false;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> open_;
};

} // namespace gmlake
