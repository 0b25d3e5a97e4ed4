"""ftrain.data: token datasets and `torchdata.nodes` loaders with exact resume.

    from ftrain import data
    build = data.build_token_dataset(data.corpora.python_stdlib(), "data/stdlib")
    train = data.TokenDataset("data/stdlib", seq_len=128, seed=0, split="train")
    batches = data.loader(train, 16, seed=0, infinite=True)   # {"input", "target"}: [16, 128]

Variable-length examples, length-bucketed and padded (with "mask"):

    docs = data.DocumentDataset("data/stdlib", max_len=512)
    batches = data.loader(docs, 16, order="length")
"""

from ftrain.data import corpora
from ftrain.data.build import BuildSummary, build_token_dataset
from ftrain.data.collate import IGNORE_INDEX, PadCollate, padding_fraction, stack_collate
from ftrain.data.datasets import DocumentDataset, TokenDataset, split_ranges
from ftrain.data.order import BucketByLength, Sequential, Shuffled, bucket_by_length
from ftrain.data.pipeline import Loader, LoaderIterator, loader
from ftrain.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "BucketByLength",
    "BuildSummary",
    "ByteTokenizer",
    "DocumentDataset",
    "HFTokenizer",
    "Loader",
    "LoaderIterator",
    "PadCollate",
    "Sequential",
    "Shuffled",
    "TokenDataset",
    "bucket_by_length",
    "build_token_dataset",
    "corpora",
    "load_tokenizer",
    "loader",
    "padding_fraction",
    "split_ranges",
    "stack_collate",
]
