"""Shared by the tests of ftrain.data's loader (tests/data/test_*.py): tiny map-style datasets whose
examples say which sample they are, and helpers to read batches."""

import itertools

import numpy as np
import torch

from ftrain import data


class Numbered:
    """n examples {"id": i, "x": [i, -i]}: a batch says which samples it holds."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": torch.tensor(i), "x": torch.tensor([i, -i])}


class Varied(Numbered):
    """Variable-length examples: example i has lengths[i] tokens, all equal to i."""

    def __init__(self, lengths):
        super().__init__(len(lengths))
        self.lengths = np.asarray(lengths)
        self.collate = data.PadCollate(pad_id=-1)

    def __getitem__(self, i):
        t = torch.full((int(self.lengths[i]),), i)
        return {"input": t, "target": t + 1}


def ids(batches) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def take(it, k: int) -> list:
    return list(itertools.islice(it, k))
