#include "engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <linux/stat.h>
#include <stdexcept>
#include <system_error>

namespace tieroffload {

bool Request::wait(double timeout_s) {
  if (done()) return true;
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return done(); });
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done(); });
}

void Request::on_done(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!done()) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void Request::op_finished(uint64_t nbytes, int err, uint64_t err_offset) {
  bytes_.fetch_add(nbytes);
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Keep the error at the lowest offset: it is the one a sequential reader would meet first.
    if (err != 0 && (error_ == 0 || err_offset < error_offset_)) {
      error_ = err;
      error_offset_ = err_offset;
    }
    if (remaining_.fetch_sub(1) != 1) return;
    done_.store(true, std::memory_order_release);
    callbacks.swap(callbacks_);
  }
  cv_.notify_all();
  for (auto& cb : callbacks) cb();
}

bool account(Op& op, int64_t res, uint64_t short_cap) {
  const uint64_t want = op.len - op.done;
  if (res < 0) {
    op.req->op_finished(op.done, static_cast<int>(-res), op.offset + op.done);
    return true;
  }
  uint64_t got = static_cast<uint64_t>(res);
  if (short_cap > 0 && got > short_cap && want > short_cap) got = short_cap;
  op.done += got;
  if (op.done == op.len) {
    op.req->op_finished(op.done, 0, 0);
    return true;
  }
  const uint64_t at = op.offset + op.done;
  // A read that returns nothing, or stops at an unaligned point under O_DIRECT, has met the
  // end of the file; a write that makes no progress cannot be resubmitted usefully.
  const bool stuck = got == 0 || (op.direct && op.align > 0 && at % op.align != 0);
  if (stuck) {
    op.req->op_finished(op.done, op.write ? EIO : ENODATA, at);
    return true;
  }
  return false;
}

Engine::Engine(const std::string& backend, int queue_depth, uint64_t block_size, int threads,
               uint64_t short_cap)
    : backend_(backend), block_size_(block_size) {
  if (queue_depth < 1) throw std::invalid_argument("queue_depth must be >= 1");
  if (block_size == 0) throw std::invalid_argument("block_size must be > 0");
  if (backend == "threads") {
    impl_ = make_threads_backend(threads, short_cap);
  } else if (backend == "io_uring") {
    impl_ = make_uring_backend(queue_depth, short_cap);
  } else {
    throw std::invalid_argument("unknown backend: " + backend);
  }
}

Engine::~Engine() { close(); }

std::shared_ptr<Request> Engine::submit(int fd, uintptr_t addr, uint64_t nbytes, uint64_t offset,
                                        bool write, bool direct, uint32_t align) {
  if (closed()) throw std::runtime_error("engine is closed");
  const uint64_t pieces = nbytes == 0 ? 0 : (nbytes + block_size_ - 1) / block_size_;
  auto req = std::make_shared<Request>(pieces == 0 ? 1 : static_cast<int>(pieces));
  if (pieces == 0) {
    req->op_finished(0, 0, 0);  // nothing to move: done at once
    return req;
  }
  std::vector<Op> ops;
  ops.reserve(pieces);
  for (uint64_t done = 0; done < nbytes; done += block_size_) {
    const uint64_t len = std::min(block_size_, nbytes - done);
    ops.push_back(Op{req, fd, reinterpret_cast<char*>(addr) + done, len, offset + done, write,
                     direct, align});
  }
  impl_->submit(std::move(ops));
  return req;
}

void Engine::hurry(const std::shared_ptr<Request>& req) {
  if (!closed() && !req->done()) impl_->hurry(req.get());
}

void Engine::close() {
  std::lock_guard<std::mutex> lk(close_mu_);
  if (closed_.exchange(true)) return;
  if (impl_) impl_->shutdown();
}

std::pair<uint32_t, uint32_t> dio_alignment(int fd) {
#ifdef SYS_statx
  struct statx stx {};
  if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align > 0) {
    return {stx.stx_dio_mem_align, stx.stx_dio_offset_align};
  }
#endif
  struct stat st {};
  if (fstat(fd, &st) != 0) throw std::system_error(errno, std::generic_category(), "fstat");
  const uint32_t blk = st.st_blksize > 0 ? static_cast<uint32_t>(st.st_blksize) : 4096;
  return {blk, blk};
}

AlignedBuffer::AlignedBuffer(size_t nbytes) : size_(nbytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  mapped_ = std::max<size_t>(page, (nbytes + page - 1) / page * page);
  // From 2 MiB up: huge-page aligned, with the slack around it unmapped, so that every whole
  // 2 MiB of it can be one huge page.
  const size_t align = mapped_ >= kHugePage ? kHugePage : page;
  const size_t span = mapped_ + align - page;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap");
  char* base = static_cast<char*>(p);
  char* start = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(base) + align - 1) / align * align);
  if (start > base) munmap(base, static_cast<size_t>(start - base));
  const size_t tail = static_cast<size_t>(base + span - (start + mapped_));
  if (tail > 0) munmap(start + mapped_, tail);
  data_ = start;
  advise_huge(data_, mapped_);
}

void advise_huge(void* addr, size_t nbytes) {
#ifdef MADV_HUGEPAGE
  if (nbytes >= kHugePage) madvise(addr, nbytes, MADV_HUGEPAGE);  // a hint: refusal is fine
#else
  (void)addr;
  (void)nbytes;
#endif
}

AlignedBuffer::~AlignedBuffer() {
  if (on_free) on_free();
  if (data_ != nullptr) munmap(data_, mapped_);
}

}  // namespace tieroffload
