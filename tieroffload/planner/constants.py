"""Fixed memory the cost model counts beside what each placement keeps resident."""

from __future__ import annotations

from ..core.mover import NBUF, STAGING_CHUNK
from ..optim.paged import CHUNK_BYTES

STAGING = STAGING_CHUNK * NBUF  # the mover's staging buffers
MACHINERY = 16 << 20      # engine, rings, worker threads and their bookkeeping
SLACK = 8 << 20           # allocator and interpreter
OPT_CHUNK = CHUNK_BYTES   # the paged optimizer's chunk of parameters
ADAM_STATE = 8            # bytes of Adam state per fp32 parameter (two moments)
