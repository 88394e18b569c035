// Page moves for host memory that is freed and refilled in place: giving pages back to the OS,
// mapping a range afresh, and moving pages between ranges with mremap (no copy, no zeroing).
// All ranges are page aligned. Errors are std::system_error carrying the errno.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tieroffload {

// Gives the pages of [addr, addr+nbytes) back to the OS; they read as zeros (MADV_DONTNEED).
void discard_pages(uintptr_t addr, size_t nbytes);

// Maps [addr, addr+nbytes) afresh as one mapping, whatever moves split it into; it reads as
// zeros and is advised for huge pages again (a new mapping loses the advice).
void renew_pages(uintptr_t addr, size_t nbytes);

// Moves the pages of [addr, addr+nbytes) to a new range and returns its address; the old range
// stays mapped and reads as zeros. Returns -errno where the kernel refuses (EINVAL before
// Linux 5.7, EFAULT for a range over two mappings): callers fall back to copying.
int64_t park_pages(uintptr_t addr, size_t nbytes);

// Moves the pages of [src, src+nbytes) (a parked range) over [dst, dst+nbytes): no page is
// zeroed or copied; src is unmapped.
void place_pages(uintptr_t src, uintptr_t dst, size_t nbytes);

// Unmaps a parked range: its pages go to the OS.
void unmap_pages(uintptr_t addr, size_t nbytes);

}  // namespace tieroffload
