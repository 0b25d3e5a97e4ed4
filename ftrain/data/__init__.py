"""ftrain.data: token datasets and `torchdata.nodes` loaders with exact resume.

    from ftrain import data
    build = data.build_token_dataset(data.corpora.python_stdlib(), "data/stdlib")
    train = data.TokenDataset("data/stdlib", seq_len=128, seed=0, split="train")
    docs = data.DocumentDataset("data/stdlib", max_len=512)   # variable-length examples
"""

from ftrain.data import corpora
from ftrain.data.collate import IGNORE_INDEX, PadCollate, padding_fraction, stack_collate
from ftrain.data.tokenizers import ByteTokenizer
from ftrain.data.tokens import (
    BuildSummary,
    DocumentDataset,
    TokenDataset,
    build_token_dataset,
    split_ranges,
)

__all__ = [
    "IGNORE_INDEX",
    "BuildSummary",
    "ByteTokenizer",
    "DocumentDataset",
    "PadCollate",
    "TokenDataset",
    "build_token_dataset",
    "corpora",
    "padding_fraction",
    "split_ranges",
    "stack_collate",
]
