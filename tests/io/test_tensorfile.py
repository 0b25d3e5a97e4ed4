"""Streaming safetensors files (ftrain.io.tensorfile): read back by safetensors itself, hashed on the
way, one tensor made at a time."""

from __future__ import annotations

import hashlib

import pytest
import safetensors
import safetensors.torch
import torch

from ftrain.io import tensorfile


def test_safetensors_reads_back_every_tensor_bit_for_bit(tmp_path):
    base = torch.randn(6, 4)
    tensors = {
        "f32": base,
        "view": base[2:4],  # shares memory with f32
        "transposed": base.t(),  # not contiguous: copied alone
        "bf16": torch.randn(5, dtype=torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "int8": torch.randint(-128, 127, (2, 2, 2), dtype=torch.int8),
    }
    file = tmp_path / "x.safetensors"
    info = tensorfile.write(file, tensors, {"format": "pt", "who": "test"})
    data = file.read_bytes()
    assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    back = safetensors.torch.load_file(file)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t)
    with safetensors.safe_open(str(file), "pt") as f:
        assert f.metadata() == {"format": "pt", "who": "test"}
        assert torch.equal(f.get_slice("f32")[1:3, 2:], base[1:3, 2:])


def test_write_lazy_makes_one_tensor_at_a_time_and_checks_it(tmp_path):
    made = []

    def get(name):
        made.append(name)
        return torch.full((2, 3), float(len(made)))

    specs = {"a": (torch.float32, [2, 3]), "b": (torch.float32, [2, 3])}
    tensorfile.write_lazy(tmp_path / "x.safetensors", specs, get)
    assert made == ["a", "b"]
    assert torch.equal(safetensors.torch.load_file(tmp_path / "x.safetensors")["b"],
                       torch.full((2, 3), 2.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"'a': expected a CPU torch.float32\[3, 3\]"):
        tensorfile.write_lazy(tmp_path / "y.safetensors", {"a": (torch.float32, [3, 3])}, get)
    with pytest.raises(TypeError, match=r"'z'.*no torch.complex64"):
        tensorfile.write(tmp_path / "z.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
