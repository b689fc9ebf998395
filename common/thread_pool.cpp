#include "common/thread_pool.h"

#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace sf {
namespace {

thread_local bool t_in_pool = false;

// One parallel region at a time (run_mu_). A worker joins a region under mu_, taking its task
// and size with it, and is counted (active_) until it leaves; run() returns only when every task
// is done and no worker is inside the region, so a worker that woke late can never claim an index
// of the next region (next_ is reset per region), and none calls a task that has gone out of
// scope. A task that throws: the first exception is kept, the region's remaining indices are
// skipped (counted, not run), and run() rethrows it on the caller once the region is empty.
class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n - 1; ++i) {
      try {
        workers_.emplace_back([this] { loop(); });
      } catch (const std::system_error& e) {
        // No thread to be had (a process or pids limit): the pool runs with those it got.
        std::fprintf(stderr, "warning: the thread pool has %d of %d threads (%s)\n", i + 1, n,
                     e.what());
        break;
      }
    }
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()) + 1; }

  void run(size_t n_tasks, const std::function<void(size_t)>& task) {
    std::lock_guard<std::mutex> run_lk(run_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lk(mu_);
      task_ = &task;
      n_tasks_ = n_tasks;
      next_.store(0);
      failed_.store(false);
      error_ = nullptr;
      done_ = 0;
      ++gen_;
    }
    cv_.notify_all();
    t_in_pool = true;
    drain(task, n_tasks);
    t_in_pool = false;
    std::exception_ptr error;
    {
      std::unique_lock<std::mutex> lk(mu_);
      done_cv_.wait(lk, [&] { return done_ == n_tasks_ && active_ == 0; });
      task_ = nullptr;  // (a worker waking from here on does not join this region)
      error = std::exchange(error_, nullptr);
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  void drain(const std::function<void(size_t)>& task, size_t n) {
    size_t i;
    size_t finished = 0;
    while ((i = next_.fetch_add(1)) < n) {
      if (!failed_.load(std::memory_order_relaxed)) {
        try {
          task(i);
        } catch (...) {
          std::lock_guard<std::mutex> lk(mu_);
          if (!error_) error_ = std::current_exception();
          failed_.store(true);
        }
      }
      ++finished;
    }
    if (finished) {
      std::lock_guard<std::mutex> lk(mu_);
      done_ += finished;
      if (done_ == n_tasks_ && active_ == 0) done_cv_.notify_all();
    }
  }
  void loop() {
    t_in_pool = true;
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(size_t)>* task = nullptr;
      size_t n = 0;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || (gen_ != seen && task_ != nullptr); });
        if (stop_) return;
        seen = gen_;
        task = task_;
        n = n_tasks_;
        ++active_;
      }
      drain(*task, n);
      {
        std::lock_guard<std::mutex> lk(mu_);
        --active_;
        if (done_ == n_tasks_ && active_ == 0) done_cv_.notify_all();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  // The region (under mu_): its task and size, the tasks done, the workers inside it.
  const std::function<void(size_t)>* task_ = nullptr;
  size_t n_tasks_ = 0;
  std::atomic<size_t> next_{0};
  size_t done_ = 0;
  int active_ = 0;
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

Pool& pool() {
  static Pool p(num_threads());
  return p;
}

}  // namespace

int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1, int(std::thread::hardware_concurrency()));
}

int num_threads() {
  static const int n = [] {
    if (const char* e = std::getenv("SF_NUM_THREADS"); e && *e) {
      // Whole numbers only: "4x" is not 4. A bad value is said once and the default used.
      char* end = nullptr;
      const long v = std::strtol(e, &end, 10);
      if (*end == '\0' && v > 0 && v <= 4096) return int(v);
      std::fprintf(stderr, "warning: SF_NUM_THREADS='%s' is not a thread count in [1, 4096]; using %d\n",
                   e, usable_cpus());
    }
    return usable_cpus();
  }();
  return n;
}

void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  const size_t max_tasks = size_t(num_threads()) * 4;
  size_t n_tasks = std::min(max_tasks, (n + grain - 1) / grain);
  if (n_tasks <= 1 || t_in_pool || num_threads() == 1) {
    fn(0, n);
    return;
  }
  const size_t chunk = (n + n_tasks - 1) / n_tasks;
  n_tasks = (n + chunk - 1) / chunk;
  pool().run(n_tasks, [&](size_t t) {
    const size_t b = t * chunk;
    const size_t e = std::min(n, b + chunk);
    if (b < e) fn(b, e);
  });
}

namespace {

template <typename T>
void copy_pair(T* da, const T* a, T* db, const T* b, size_t n, size_t grain) {
  parallel_for(
      2 * n,
      [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi;) {
          const bool second = i >= n;
          const size_t off = second ? i - n : i, len = std::min(hi, second ? 2 * n : n) - i;
          std::memcpy((second ? db : da) + off, (second ? b : a) + off, len * sizeof(T));
          i += len;
        }
      },
      grain);
}

}  // namespace

void parallel_copy_pair(float* da, const float* a, float* db, const float* b, size_t n,
                        size_t grain) {
  copy_pair(da, a, db, b, n, grain);
}

void parallel_copy_pair(uint16_t* da, const uint16_t* a, uint16_t* db, const uint16_t* b, size_t n,
                        size_t grain) {
  copy_pair(da, a, db, b, n, grain);
}

namespace {

// madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside [p, p + bytes); a hint: errors (no
// THP in this kernel, "never" mode) leave ordinary pages.
void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool on = [] {
    const char* e = std::getenv("SF_HOST_HUGEPAGES");
    return !(e && std::string(e) == "0");
  }();
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (!on || bytes < 2 * kHuge) return;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

template <typename T>
bool size_vector_of(std::vector<T>& v, size_t n) {
  try {
    if (v.capacity() < n) {
      std::vector<T>().swap(v);
      v.reserve(n);  // allocated, not touched yet
      advise_huge_pages(v.data(), n * sizeof(T));
    }
    v.resize(n);
    return true;
  } catch (const std::bad_alloc&) {
    return false;
  } catch (const std::length_error&) {  // more than a vector can hold
    return false;
  }
}

}  // namespace

bool size_vector(std::vector<float>& v, size_t n) { return size_vector_of(v, n); }
bool size_vector(std::vector<uint16_t>& v, size_t n) { return size_vector_of(v, n); }

bool size_vectors(std::span<std::vector<float>* const> vs, size_t n) {
  std::atomic<bool> ok{true};
  parallel_for(vs.size(), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i)
      if (!size_vector(*vs[i], n)) ok = false;
  });
  return ok;
}

Status run_items(size_t n, int width, const std::function<Status(size_t)>& fn) {
  std::vector<Status> st(n);
  std::atomic<size_t> next{0};
  // The lowest failed index so far. Items are taken in index order, so every item below the
  // final one was taken and ran to its end: the first error in index order is the same at any
  // width, and the items after a failure need not start.
  std::atomic<size_t> failed{n};
  // An exception must not leave a helper thread (std::terminate): it becomes the item's error.
  const auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      if (i > failed.load()) continue;
      try {
        st[i] = fn(i);
      } catch (const std::bad_alloc&) {
        st[i] = SF_ERR(kResourceExhausted, "out of memory in item " + std::to_string(i));
      } catch (const std::exception& e) {
        st[i] = SF_ERR(kInternal, "item " + std::to_string(i) + " threw: " + e.what());
      }
      if (!st[i].is_ok())
        for (size_t f = failed.load(); i < f && !failed.compare_exchange_weak(f, i);) {
        }
    }
  };
  std::vector<std::thread> helpers;
  // Joined on every way out, an exception from this thread's share included (a joinable
  // std::thread destroyed would terminate the process).
  struct JoinAll {
    std::vector<std::thread>& ts;
    ~JoinAll() {
      for (std::thread& t : ts)
        if (t.joinable()) t.join();
    }
  } join_all{helpers};
  const size_t want = std::min(n, size_t(std::max(1, width)));
  helpers.reserve(want);  // (growing it while threads run would destroy joinable ones)
  for (size_t t = 1; t < want; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::exception&) {  // no thread to be had: the running ones do it all
      break;
    }
  }
  work();
  for (std::thread& h : helpers) h.join();
  for (const Status& s : st) SF_TRY(s);
  return Status::ok();
}

}  // namespace sf
