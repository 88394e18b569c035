#include "pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <system_error>

#include "engine.h"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux 5.7; older glibc headers lack the name
#endif

namespace tieroffload {

namespace {
[[noreturn]] void fail(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}
void* ptr(uintptr_t addr) { return reinterpret_cast<void*>(addr); }
}  // namespace

void discard_pages(uintptr_t addr, size_t nbytes) {
  if (madvise(ptr(addr), nbytes, MADV_DONTNEED) != 0) fail("madvise");
}

void renew_pages(uintptr_t addr, size_t nbytes) {
  if (mmap(ptr(addr), nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
           -1, 0) == MAP_FAILED)
    fail("mmap");
  advise_huge(ptr(addr), nbytes);
}

int64_t park_pages(uintptr_t addr, size_t nbytes) {
  // The new range keeps the old one's offset within a huge page: the kernel then moves each
  // whole huge page as one page-table entry. At an address of its own choosing it splits every
  // huge page into 512 (a 32 MiB park took 0.7 ms, and the unit it was placed over next was
  // left without huge pages). Reserve room for that, move into it, trim the rest.
  const size_t span = nbytes + kHugePage;
  void* r = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return -errno;
  const uintptr_t base = reinterpret_cast<uintptr_t>(r);
  const uintptr_t off = addr % kHugePage;
  const uintptr_t dst = (base - off + kHugePage - 1) / kHugePage * kHugePage + off;
  void* p = mremap(ptr(addr), nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP,
                   ptr(dst));
  if (p == MAP_FAILED) {
    const int err = errno;
    munmap(r, span);
    return -err;
  }
  if (dst > base) munmap(r, dst - base);
  if (base + span > dst + nbytes) munmap(ptr(dst + nbytes), base + span - dst - nbytes);
  return static_cast<int64_t>(dst);
}

void place_pages(uintptr_t src, uintptr_t dst, size_t nbytes) {
  if (mremap(ptr(src), nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED, ptr(dst)) == MAP_FAILED)
    fail("mremap");
}

void unmap_pages(uintptr_t addr, size_t nbytes) {
  if (munmap(ptr(addr), nbytes) != 0) fail("munmap");
}

}  // namespace tieroffload
