"""Data and tensor parallelism on ``torch.distributed``: what both use here (process-group set-up
(``launch``), flat collectives (``collectives``), DTensor plumbing (``dtensor``)), data parallelism
in ``data_parallel`` (ZeRO layouts, FSDP gathering, the split over ``dp`` of a tensor-parallel
state) and tensor parallelism in ``tensor_parallel`` (plans, the mesh, model copies, sequence
parallelism, the vocabulary-parallel loss). The ``ft.shard`` and
``ft.tensor_parallel`` transforms (``ftrain.transforms``) are built from these.

    torchrun --nproc_per_node 2 -m ftrain train --shard fsdp
    torchrun --nproc_per_node 4 -m ftrain train --shard fsdp --tp 2   # fsdp over dp x tp
    results = ft.distributed.run_distributed(fn, world_size=2)   # in tests and notebooks
    state = ft.distributed.sharded_init(lambda: GPT(config), opt, "fsdp")  # never whole
"""

from ftrain.distributed.data_parallel.born import sharded_init
from ftrain.distributed.data_parallel.born_loaded import NotLaidOut, sharded_params_from_files
from ftrain.distributed.data_parallel.fsdp import track_gathered
from ftrain.distributed.data_parallel.zero import (
    STRATEGIES,
    local_bytes,
    shard_state,
    unshard,
    unshard_state,
)
from ftrain.distributed.launch import (
    DistributedError,
    check_mesh,
    default_mesh,
    init,
    is_initialized,
    rank_and_world,
    require_group,
    run_distributed,
)
from ftrain.distributed.tensor_parallel.mesh import tp_mesh
from ftrain.distributed.tensor_parallel.plans import (
    Colwise,
    Divide,
    Rowwise,
    SequenceParallel,
    gpt_plan,
    hf_gpt2_plan,
    hf_llama_plan,
)
from ftrain.distributed.tensor_parallel.sequence import (
    colwise_linear_sp,
    gather_sequence,
    reduce_scatter_sequence,
    rowwise_linear_sp,
    sequence_dropout,
    split_sequence,
    sum_partial_grads,
)
from ftrain.distributed.tensor_parallel.vocab_loss import (
    vocab_parallel_cross_entropy,
    vocab_parallel_token_losses,
)

__all__ = [
    "Colwise",
    "Divide",
    "Rowwise",
    "SequenceParallel",
    "gpt_plan",
    "hf_gpt2_plan",
    "hf_llama_plan",
    "tp_mesh",
    "STRATEGIES",
    "DistributedError",
    "check_mesh",
    "colwise_linear_sp",
    "default_mesh",
    "gather_sequence",
    "init",
    "is_initialized",
    "local_bytes",
    "rank_and_world",
    "reduce_scatter_sequence",
    "rowwise_linear_sp",
    "require_group",
    "run_distributed",
    "sequence_dropout",
    "shard_state",
    "sharded_init",
    "sharded_params_from_files",
    "NotLaidOut",
    "split_sequence",
    "sum_partial_grads",
    "track_gathered",
    "unshard",
    "unshard_state",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_token_losses",
]
