"""meta.json helpers (ftrain.io.meta), shared by whole and sharded checkpoints. ``load``'s refusals
of a damaged meta.json are tested in test_io_checkpoint.py."""

from __future__ import annotations

import json

import pytest

from ftrain.io import meta


def test_meta_checksum_ignores_formatting_and_its_own_key():
    body = {"format": meta.FORMAT, "step": 3, "extra": {"b": [1, 2], "a": None}}
    reordered = json.loads(json.dumps(body, indent=4, sort_keys=True))
    assert meta.meta_checksum(body) == meta.meta_checksum({**reordered, "meta_sha256": "x"})
    assert meta.meta_checksum(body) != meta.meta_checksum({**body, "step": 4})


def test_verify_file_names_the_file(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"12345")
    digest, size = meta.hash_file(tmp_path / "a.safetensors")
    meta.verify_file(tmp_path, "a.safetensors", {"sha256": digest, "bytes": size})
    with pytest.raises(meta.CheckpointError, match=r"a.safetensors is damaged \(sha256"):
        meta.verify_file(tmp_path, "a.safetensors", {"sha256": "0" * 64, "bytes": size})
    with pytest.raises(meta.CheckpointError, match=r"b.safetensors is missing"):
        meta.verify_file(tmp_path, "b.safetensors", {"sha256": digest, "bytes": size})
    assert meta.checked_json({"t": (1, 2)}) == {"t": [1, 2]}
