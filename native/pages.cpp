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
  void* p = mremap(ptr(addr), nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_DONTUNMAP, nullptr);
  return p == MAP_FAILED ? -errno : static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
}

void place_pages(uintptr_t src, uintptr_t dst, size_t nbytes) {
  if (mremap(ptr(src), nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED, ptr(dst)) == MAP_FAILED)
    fail("mremap");
}

void unmap_pages(uintptr_t addr, size_t nbytes) {
  if (munmap(ptr(addr), nbytes) != 0) fail("munmap");
}

}  // namespace tieroffload
