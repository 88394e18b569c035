"""Composition with other systems: FSDP2 shards, DDP's gradient deferral, DeepSpeed configs."""
