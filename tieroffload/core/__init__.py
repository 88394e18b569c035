"""Units and how they move: a unit's states, its home (RAM or an NVMe extent), the staging
buffers, the mover thread, and the scheduler that prefetches along the recorded order under a
budget. Knows nothing of hooks or modules beyond the parameters a unit holds. Its modules
import bottom-up: units < staging < homes < mover < scheduler."""
