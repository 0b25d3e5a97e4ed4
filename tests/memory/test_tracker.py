"""LiveBytes: live and peak bytes follow allocations and frees, on real and fake tensors alike."""

import torch

from ftrain.memory.tracker import LiveBytes, fake_mode


def run(make):
    live = LiveBytes()
    with live:
        make()
    return live


def body():
    a = torch.ones(1000)  # 4000 bytes
    b = a * 2  # +4000: 8000 alive
    v = b.view(10, 100)  # a view: nothing new
    del a  # 4000 alive
    c = torch.empty(500, dtype=torch.float64)  # +4000: 8000 again, not a new peak
    return v, c


def test_real_and_fake_count_the_same():
    real = run(body)
    mode = fake_mode()
    with mode:
        fake = run(body)
    assert real.peak == fake.peak == 8000
    assert real.live == fake.live == 0  # everything freed once the results are dropped


def test_hold_marks_and_flops():
    x = torch.ones(100, 100)
    live = LiveBytes()
    live.hold([x, x.t()])  # one storage
    assert live.live == 40000
    with live:
        live.mark("mm")
        y = x @ x
        assert live.since("mm") == 80000
    assert live.flops == 2 * 100**3
    del y
    assert live.live == 40000


def test_fresh_only_skips_what_existed_before():
    x = torch.ones(1000)  # made before: 4000 bytes
    counts = {}
    for fresh in (False, True):
        live = LiveBytes(fresh_only=fresh)
        with live:
            v = x.view(10, 100)  # a view of an older storage
            x.mul_(1)  # in place on it
            y = x + 1  # new: 4000
            counts[fresh] = live.live
        del v, y
    assert counts == {False: 8000, True: 4000}


def test_a_transient_counts_toward_the_peaks_for_one_op_only():
    def only_cat(func, args, kwargs):
        return 10_000 if func is torch.ops.aten.cat.default else 0

    live = LiveBytes(transient=only_cat)
    with live:
        a = torch.ones(1000)  # 4000
        live.mark("cat")
        b = torch.cat([a, a])  # +8000 alive, and 10000 more while cat runs
        c = a + 1  # +4000: live 16000, under the peak the transient made
    assert live.peak == 4000 + 8000 + 10_000 and live.since("cat") == live.peak
    assert live.live == 4000 + 8000 + 4000  # never counted as alive
    del a, b, c


def test_fake_like_keeps_small_leaves_real_and_fakes_the_rest():
    from ftrain.memory.tracker import fake_like, is_fake

    mode = fake_mode()
    counter = torch.tensor(3)
    big = torch.ones(100, 4)
    assert fake_like(counter, mode) is counter  # read as a number by the step
    fake = fake_like(big, mode)
    assert is_fake(fake) and fake.shape == big.shape and not is_fake(big)
    assert fake_like(torch.empty(2, device="meta"), mode).sum().item() == 0  # real zeros


def test_host_bytes_are_counted_apart_from_the_devices():
    live = LiveBytes(host=torch.device("cpu"))
    with fake_mode(), live:
        d = torch.empty(1000, device="meta")  # 4000 bytes on the "device" (meta stands in)
        live.mark("m")
        h = torch.empty(250, dtype=torch.float64)  # 2000 bytes on the host
        h2 = h + 1  # +2000 on the host
        del h, h2
        d2 = d.to("cpu")  # a device-to-host copy: 4000 on the host
    assert (live.peak, live.live) == (4000, 4000)  # d: the device never saw the host's bytes
    assert live.host_peak == 4000 and live.host_live == d2.numel() * d2.element_size()
    assert live.since("m") == 4000 and live.host_since("m") == 4000 and live.host_marks["m"] == 0
    plain = LiveBytes()  # without host: every storage in one count
    with fake_mode(), plain:
        d = torch.empty(1000, device="meta")
        d2 = d.to("cpu")
    assert plain.peak == 8000 and plain.host_peak == 0
