// Objects reused by the items of one parallel call (run_items): each item takes one, and it
// returns to the list when the item's lease ends, so at most one object per item in flight is
// ever built (buffers of hundreds of MB are page-faulted in once, not once an item).
#pragma once
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace sf {

template <typename T>
class FreeList {
 public:
  // Holds one object; gives it back to its list when destroyed.
  class Lease {
   public:
    Lease(FreeList* list, std::unique_ptr<T> obj) : list_(list), obj_(std::move(obj)) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (obj_) list_->give(std::move(obj_));
    }
    T& operator*() const { return *obj_; }
    T* operator->() const { return obj_.get(); }

   private:
    FreeList* list_;
    std::unique_ptr<T> obj_;
  };

  // A free object (as its last holder left it), or a new default-constructed one.
  Lease take() {
    std::unique_ptr<T> obj;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_.empty()) {
        obj = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!obj) obj = std::make_unique<T>();
    return Lease(this, std::move(obj));
  }

 private:
  void give(std::unique_ptr<T> obj) {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(std::move(obj));
  }
  std::mutex mu_;
  std::vector<std::unique_ptr<T>> free_;
};

}  // namespace sf
