// tieroffload native I/O engine: addresses, byte counts, file descriptors and offsets only.
// No PyTorch headers, so it builds in seconds and survives torch upgrades.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tieroffload {

// One user request (a whole tensor): split into block-sized ops, completed when all ops are.
class Request {
 public:
  explicit Request(int pieces) : remaining_(pieces) {}

  bool done() const { return done_.load(std::memory_order_acquire); }
  // Blocks until done or until timeout_s (< 0: forever). Returns done().
  bool wait(double timeout_s);
  uint64_t bytes() const { return bytes_.load(); }
  int error() const { return error_; }
  uint64_t error_offset() const { return error_offset_; }
  // Runs fn once the request is done: at once (in the caller) if it already is, else in the
  // completing thread.
  void on_done(std::function<void()> fn);

  // Called by backends, once per op.
  void op_finished(uint64_t nbytes, int err, uint64_t err_offset);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> remaining_;
  std::atomic<bool> done_{false};
  std::atomic<uint64_t> bytes_{0};
  int error_ = 0;
  uint64_t error_offset_ = 0;
  std::vector<std::function<void()>> callbacks_;
};

// One block-sized piece of a request.
struct Op {
  std::shared_ptr<Request> req;
  int fd;
  char* addr;
  uint64_t len;
  uint64_t offset;
  bool write;
  bool direct;
  uint32_t align;   // offset alignment needed when direct
  uint64_t done = 0;  // bytes already transferred (short I/O is resubmitted for the rest)
};

// What to do after a syscall moved `res` bytes (or failed with -errno) for op.
// Returns true when the op is finished (completed or failed), false when the rest must be
// resubmitted. `short_cap` > 0 pretends the kernel moved at most that many bytes (tests).
bool account(Op& op, int64_t res, uint64_t short_cap);

// The small interface every backend implements.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual void submit(std::vector<Op>&& ops) = 0;
  // Moves the ops of `req` that wait for a slot ahead of every other waiting op, in their
  // order: someone is blocked on req, nobody yet on the rest.
  virtual void hurry(const Request* req) = 0;
  // Finishes what is in flight, then stops the workers.
  virtual void shutdown() = 0;
};

std::unique_ptr<Backend> make_threads_backend(int threads, uint64_t short_cap);
// Throws std::system_error with the errno when io_uring cannot be set up here.
std::unique_ptr<Backend> make_uring_backend(int queue_depth, uint64_t short_cap);
bool uring_compiled();
// 0 when an io_uring ring can be created here, else the errno (EPERM/ENOSYS under seccomp).
int uring_probe();

class Engine {
 public:
  Engine(const std::string& backend, int queue_depth, uint64_t block_size, int threads,
         uint64_t short_cap);
  ~Engine();
  const std::string& backend() const { return backend_; }
  std::shared_ptr<Request> submit(int fd, uintptr_t addr, uint64_t nbytes, uint64_t offset,
                                  bool write, bool direct, uint32_t align);
  // Runs the not yet started pieces of `req` before every other waiting piece (a no-op once
  // the engine is closed: nothing waits then).
  void hurry(const std::shared_ptr<Request>& req);
  void close();
  bool closed() const { return closed_.load(); }

 private:
  std::string backend_;
  uint64_t block_size_;
  std::unique_ptr<Backend> impl_;
  std::atomic<bool> closed_{false};
  std::mutex close_mu_;
};

// Direct-I/O alignment of an open file: {memory alignment, offset/size alignment}.
// Asks statx(STATX_DIOALIGN) and falls back to st_blksize.
std::pair<uint32_t, uint32_t> dio_alignment(int fd);

constexpr size_t kHugePage = size_t{2} << 20;

// Asks for transparent huge pages over [addr, addr+nbytes) (MADV_HUGEPAGE; ignored where the
// kernel has none). Physically contiguous 2 MiB pages let one direct-I/O request carry a few
// large segments instead of one per 4 KiB page: a device that takes at most 254 segments
// (virtio-blk) then sees requests of its full size, not of 1 MiB, and the kernel pins, maps
// and moves (mremap) 512 times fewer pages.
void advise_huge(void* addr, size_t nbytes);

// Page-aligned anonymous memory (mmap), returned to the OS when freed. From 2 MiB up it is
// aligned to 2 MiB and advised for huge pages (advise_huge).
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t nbytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }
  size_t size() const { return size_; }
  // Runs just before the memory is unmapped (e.g. to unregister it from CUDA).
  std::function<void()> on_free;

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
};

}  // namespace tieroffload
