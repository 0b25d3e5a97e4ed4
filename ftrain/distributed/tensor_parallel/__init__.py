"""Tensor parallelism (``ft.tensor_parallel``): plans (``plans``: which layers split by columns or
rows), the ``(dp, tp)`` mesh and where a state's tensors sit on it (``mesh``), the
column/row-parallel linears (``linear``), the model copy a forward runs (``model``), sequence
parallelism (``sequence``, wired in by ``sequence_region``) and the vocabulary-parallel loss
(``vocab_loss``). ``ftrain.distributed`` re-exports the public names.
"""
