"""Pipeline parallelism's parts: where a model is cut into stages and each stage's module
(``cut``), what a model family is (``family``), the families whose stages ftrain knows how to
run (``cut``: the built-in GPT; ``hf``: Hugging Face GPT-2 and Llama), one rank's stages under
``torch.distributed.pipelining``'s schedule (``runner``), which tensors of a state each rank
keeps (``layout``), and the ``("dp", "pp", "tp")`` mesh
(``mesh``). The ``ft.pipeline`` transform (``ftrain.transforms.pipeline``) is built from these."""

from ftrain.distributed.pipeline.cut import GPT_FAMILY, Family, families, family_of
from ftrain.distributed.pipeline.mesh import pp_mesh
from ftrain.distributed.pipeline.runner import SCHEDULES

__all__ = ["GPT_FAMILY", "Family", "SCHEDULES", "families", "family_of", "pp_mesh"]
