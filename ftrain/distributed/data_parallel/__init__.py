"""Data parallelism (``ft.shard``): what each process keeps under ddp, zero1, zero2 and fsdp
(``zero``), fsdp's per-block gathering (``fsdp``), the split over ``dp`` of a tensor-parallel state
(``dp_split``) and whole-tensor functions computed once on an owner rank (``owners``).
``ftrain.distributed`` re-exports the public names.
"""
