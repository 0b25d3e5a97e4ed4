"""Data parallelism (``ft.shard``): what each process keeps under ddp, zero1, zero2 and fsdp
(``zero``), fsdp's per-block gathering (``fsdp``), the split over ``dp`` of a tensor-parallel state
(``dp_split``), whole-tensor functions computed once on an owner rank (``owners``) and a state
born as this process's shards, never whole (``born``).
``ftrain.distributed`` re-exports the public names.
"""
