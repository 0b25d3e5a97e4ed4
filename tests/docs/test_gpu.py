"""docs/gpu.md: every flag its `ftrain train` lines use is a setting of the command, every file it
names exists, and the error it shows is the one the command prints."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from ftrain.app.cli import main
from ftrain.app.config import TrainConfig, flag_name

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "gpu.md").read_text()


def test_every_train_flag_in_the_guide_is_a_setting():
    names = [flag_name(f.name) for f in dataclasses.fields(TrainConfig)]
    known = {f"--{n}" for n in names} | {f"--no-{n}" for n in names}
    used = set()
    for block in re.findall(r"```bash\n(.*?)```", GUIDE, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "ftrain train" in line:
                command = line.split("ftrain train", 1)[1].split("#")[0]
                used.update(re.findall(r"--[a-z][\w-]*", command))
    assert {"--device", "--precision", "--no-tf32", "--shard", "--resume"} <= used
    assert used <= known, sorted(used - known)


def test_the_files_the_guide_links_exist():
    for link in re.findall(r"\]\(([^)#]+)\)", GUIDE):
        assert (ROOT / "docs" / link).resolve().is_file(), link


def test_the_error_the_guide_shows_is_what_the_command_prints(monkeypatch, capsys):
    shown = re.search(r"^ftrain train: error: --device cuda: .*$", GUIDE, re.M).group(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["train", "--device", "cuda"])
    printed = capsys.readouterr().err.splitlines()[-1]
    head, tail = shown.split("(...)")
    assert printed.startswith(head) and printed.endswith(tail)
