"""Byte sizes as people write them, and the reports' tables."""

import pytest

from ftrain.memory.report import Candidate, FitReport, MemoryReport, format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4GiB", 4 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4G", 4 * 2**30),
        ("100", 100),
        (2048, 2048),
        ("3kb", 3000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "4 gigs", "-1GiB", "0", 0, True, "GiB"])
def test_parse_bytes_refuses_with_the_legal_forms(bad):
    with pytest.raises((ValueError, TypeError), match="budget"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"


def test_tables_name_every_part():
    r = MemoryReport(10, 10, 20, 5, 7, 1, 48, "update", 2, 100, ("accumulate",))
    assert r.state == 40
    text = str(r)
    for part in ("params", "gradients", "optimizer state", "activations (1 of 2", "peak (update)"):
        assert part in text
    c = Candidate(2, "blocks", "bf16", None, 48, 1.0, True)
    fit = FitReport(64, c, (c,), r, "why")
    assert "k=2 blocks bf16" in str(fit) and "<- chosen" in str(fit) and "why" in str(fit)


def test_a_device_plan_shows_the_host_beside_the_device():
    r = MemoryReport(
        10,
        10,
        0,
        5,
        7,
        1,
        28,
        "forward/backward",
        1,
        100,
        ("offload",),
        device="cuda",
        host_optimizer=20,
        host_update=30,
        host_peak=50,
    )
    assert r.host_apart and r.device_peak == r.peak == 28 and r.host_state == 20
    header, *rows = str(r).splitlines()[1:]
    assert header.split() == ["cuda", "host"]
    peak = next(line for line in rows if line.lstrip().startswith("peak"))
    assert peak.split()[-4:] == ["28", "B", "50", "B"]
    cpu = MemoryReport(10, 10, 20, 5, 7, 1, 48, "update", 2, 100, ())
    assert not cpu.host_apart and "host == device" in str(cpu)
