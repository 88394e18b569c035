// Portable backend: a pool of workers doing pread/pwrite, one op each at a time.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "engine.h"

namespace tieroffload {
namespace {

class ThreadsBackend : public Backend {
 public:
  ThreadsBackend(int threads, uint64_t short_cap) : short_cap_(short_cap) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }
  ~ThreadsBackend() override { shutdown(); }

  void submit(std::vector<Op>&& ops) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& op : ops) queue_.push_back(std::move(op));
    }
    cv_.notify_all();
  }

  void hurry(const Request* req) override {
    std::lock_guard<std::mutex> lk(mu_);
    std::stable_partition(queue_.begin(), queue_.end(),
                          [req](const Op& op) { return op.req.get() == req; });
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  void run() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and all queued work is done
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      for (;;) {
        const uint64_t want = op.len - op.done;
        char* p = op.addr + op.done;
        const off_t off = static_cast<off_t>(op.offset + op.done);
        ssize_t r = op.write ? pwrite(op.fd, p, want, off) : pread(op.fd, p, want, off);
        if (r < 0 && errno == EINTR) continue;
        if (account(op, r < 0 ? -errno : r, short_cap_)) break;
      }
    }
  }

  uint64_t short_cap_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> make_threads_backend(int threads, uint64_t short_cap) {
  return std::make_unique<ThreadsBackend>(threads < 1 ? 1 : threads, short_cap);
}

}  // namespace tieroffload
