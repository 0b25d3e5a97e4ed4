"""ftrain.data: token datasets and `torchdata.nodes` loaders with exact resume.

    from ftrain import data
    build = data.build_token_dataset(data.corpora.python_stdlib(), "data/stdlib")
    train = data.TokenDataset("data/stdlib", seq_len=128, seed=0, split="train")
    batches = data.loader(train, 16, seed=0, infinite=True)   # {"input", "target"}: [16, 128]

Variable-length examples, length-bucketed and padded (with "mask"):

    docs = data.DocumentDataset("data/stdlib", max_len=512)
    batches = data.loader(docs, 16, order="length")

Your own data: `data_files(path)` (a file or a folder) into `build_token_dataset`, which reads
text files, `.jsonl` (`text`; chat `messages` or ShareGPT `conversations`, with a loss mask on the
assistant's tokens; `prompt`/`completion`, with the loss on the completion) and `.parquet`; `TokenDataset(..., pack=True)` adds `position_ids` that restart at each document.
"""

from ftrain.data import corpora
from ftrain.data.build import BuildSummary, build_token_dataset
from ftrain.data.chat import (
    BUILTIN_CHAT_TEMPLATE,
    TemplatedTokenizer,
    encode_chat,
    encode_completion,
    end_of_turn,
    parse_chat_roles,
    render_chat,
    template_of,
    with_chat_template,
)
from ftrain.data.collate import IGNORE_INDEX, PadCollate, padding_fraction, stack_collate
from ftrain.data.datasets import DocumentDataset, TokenDataset, restarting_positions, split_ranges
from ftrain.data.documents import DataError, Document, data_files, read_documents
from ftrain.data.order import BucketByLength, Sequential, Shuffled, bucket_by_length
from ftrain.data.pipeline import Loader, LoaderIterator, loader
from ftrain.data.splits import DEFAULT_SPLITS, SplitPlan, plan_split
from ftrain.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "DataError",
    "Document",
    "TemplatedTokenizer",
    "data_files",
    "encode_chat",
    "encode_completion",
    "end_of_turn",
    "parse_chat_roles",
    "read_documents",
    "render_chat",
    "template_of",
    "with_chat_template",
    "restarting_positions",
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
    "DEFAULT_SPLITS",
    "SplitPlan",
    "plan_split",
    "stack_collate",
]
