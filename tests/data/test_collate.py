"""ftrain.data's collate functions (ftrain/data/collate.py): PadCollate pads, masks and ignores
the padding, and the losses skip it."""

import pytest
import torch

from ftrain import data


def test_pad_collate_pads_masks_and_ignores():
    examples = [
        {
            "input": torch.tensor([1, 2, 3]),
            "target": torch.tensor([2, 3, 4]),
            "w": torch.tensor(1.0),
        },
        {"input": torch.tensor([5]), "target": torch.tensor([6]), "w": torch.tensor(2.0)},
    ]
    b = data.PadCollate(pad_id=0)(examples)
    assert b["input"].tolist() == [[1, 2, 3], [5, 0, 0]]
    assert b["target"].tolist() == [[2, 3, 4], [6, -100, -100]]
    assert b["mask"].tolist() == [[True, True, True], [True, False, False]]
    assert b["w"].tolist() == [1.0, 2.0]
    assert data.padding_fraction(b) == pytest.approx(2 / 6)
    b8 = data.PadCollate(pad_to_multiple_of=8)(examples)
    assert b8["input"].shape == (2, 8) and int(b8["mask"].sum()) == 4
    assert (b8["target"][~b8["mask"]] == data.IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="different lengths"):
        data.PadCollate()([{"input": torch.zeros(2), "target": torch.zeros(3)}])
    # the losses skip the padding: a padded batch gives the same loss as its examples
    logits = torch.randn(2, 8, 5)
    tgt = b8["target"].clamp(max=4)
    tgt[~b8["mask"]] = -100
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum")
    by_hand = sum(
        torch.nn.functional.cross_entropy(logits[i, :n], tgt[i, :n], reduction="sum")
        for i, n in enumerate([3, 1])
    )
    assert torch.allclose(total, by_hand)
