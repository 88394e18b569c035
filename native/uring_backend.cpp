// io_uring backend: callers submit straight into the ring (under a lock); one reaper thread
// takes completions, resubmits short I/O and refills the ring up to queue_depth.
#include <algorithm>
#include <cerrno>
#include <system_error>
#include <thread>

#include "engine.h"

#ifdef TIEROFFLOAD_HAVE_LIBURING
#include <liburing.h>
#endif

namespace tieroffload {

#ifdef TIEROFFLOAD_HAVE_LIBURING
namespace {

class UringBackend : public Backend {
 public:
  UringBackend(int queue_depth, uint64_t short_cap) : qd_(queue_depth), short_cap_(short_cap) {
    io_uring_params params{};
    int r = io_uring_queue_init_params(static_cast<unsigned>(queue_depth), &ring_, &params);
    if (r < 0) throw std::system_error(-r, std::generic_category(), "io_uring_queue_init");
#if defined(IOSQE_ASYNC) && defined(IORING_FEAT_FAST_POLL)
    // IOSQE_ASYNC came in Linux 5.6, FAST_POLL in 5.7: a kernel with the one has the other.
    async_ = (params.features & IORING_FEAT_FAST_POLL) != 0;
#endif
    reaper_ = std::thread([this] { reap(); });
  }
  ~UringBackend() override {
    shutdown();
    io_uring_queue_exit(&ring_);
  }

  void submit(std::vector<Op>&& ops) override {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& op : ops) pending_.push_back(new Op(std::move(op)));
    fill();
  }

  void hurry(const Request* req) override {
    std::lock_guard<std::mutex> lk(mu_);
    std::stable_partition(pending_.begin(), pending_.end(),
                          [req](const Op* op) { return op->req.get() == req; });
  }

  void shutdown() override {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stopping_) return;
      stopping_ = true;
      idle_.wait(lk, [&] { return inflight_ == 0 && pending_.empty(); });
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, nullptr);  // tells the reaper to stop
      io_uring_submit(&ring_);
    }
    reaper_.join();
  }

 private:
  // Moves pending ops into the ring while fewer than queue_depth are in flight. Holds mu_.
  void fill() {
    int prepared = 0;
    while (inflight_ < qd_ && !pending_.empty()) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      Op* op = pending_.front();
      pending_.pop_front();
      const uint64_t want = op->len - op->done;
      const unsigned n = static_cast<unsigned>(std::min<uint64_t>(want, 1u << 30));
      if (op->write) {
        io_uring_prep_write(sqe, op->fd, op->addr + op->done, n, op->offset + op->done);
      } else {
        io_uring_prep_read(sqe, op->fd, op->addr + op->done, n, op->offset + op->done);
      }
      io_uring_sqe_set_data(sqe, op);
      // Issued from the kernel's io-wq workers, not inline: an inline O_DIRECT submission
      // sleeps in the block layer while the device queue is full (30 to 100 ms for 32 MiB on
      // a busy disk), and the thread submitting is the one that computes.
#ifdef IOSQE_ASYNC
      if (async_) sqe->flags |= IOSQE_ASYNC;
#endif
      ++inflight_;
      ++prepared;
    }
    // SQEs not taken now stay in the ring and go with the next io_uring_submit.
    if (prepared > 0) io_uring_submit(&ring_);
  }

  void reap() {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int r = io_uring_wait_cqe(&ring_, &cqe);
      if (r == -EINTR) continue;
      if (r < 0) throw std::system_error(-r, std::generic_category(), "io_uring_wait_cqe");
      bool stop = false;
      std::vector<Op*> again;
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        Op* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
        if (op == nullptr) {
          stop = true;
          continue;
        }
        const int res = cqe->res;
        if (res == -EAGAIN || res == -EINTR) {
          again.push_back(op);
        } else if (account(*op, res, short_cap_)) {
          delete op;
        } else {
          again.push_back(op);
        }
      }
      io_uring_cq_advance(&ring_, seen);
      {
        std::lock_guard<std::mutex> lk(mu_);
        inflight_ -= static_cast<int>(seen) - (stop ? 1 : 0);
        for (auto it = again.rbegin(); it != again.rend(); ++it) pending_.push_front(*it);
        fill();
        if (inflight_ == 0 && pending_.empty()) idle_.notify_all();
      }
      if (stop) return;
    }
  }

  io_uring ring_{};
  const int qd_;
  const uint64_t short_cap_;
  std::mutex mu_;
  std::condition_variable idle_;
  std::deque<Op*> pending_;
  int inflight_ = 0;
  bool stopping_ = false;
  bool async_ = false;
  std::thread reaper_;
};

}  // namespace

bool uring_compiled() { return true; }

int uring_probe() {
  io_uring ring{};
  int r = io_uring_queue_init(2, &ring, 0);
  if (r < 0) return -r;
  io_uring_queue_exit(&ring);
  return 0;
}

std::unique_ptr<Backend> make_uring_backend(int queue_depth, uint64_t short_cap) {
  return std::make_unique<UringBackend>(queue_depth, short_cap);
}

#else

bool uring_compiled() { return false; }
int uring_probe() { return ENOSYS; }
std::unique_ptr<Backend> make_uring_backend(int, uint64_t) {
  throw std::system_error(ENOSYS, std::generic_category(),
                          "tieroffload was built without liburing");
}

#endif

}  // namespace tieroffload
