"""ftrain.step.explain: ``step.explain()`` and ``step.explain_rows()`` report, for each hook in the
order it runs, the transforms acting there (only where they act) and whether it runs eagerly or
compiled, worked out from what the step resolved when it was built."""

import torch

import ftrain as ft

from _tiny import gpt_step


def test_explain_lists_each_hook_in_the_order_it_runs_with_its_transforms():
    """``step.explain()`` is worked out from what the step resolved: a transform is listed at a
    hook only where it acts (``ft.autocast`` to bf16 has no loss scale), in the order the hooks
    run, and every hook inside the step is marked compiled under ``ft.compile``."""
    _, step, _ = gpt_step()
    bf16 = ft.autocast(ft.accumulate(step, 2), torch.bfloat16, tf32=True)
    rows = {r.hook: r for r in bf16.explain_rows()}
    assert rows["split"].transforms == ("accumulate",)
    assert rows["forward"].transforms == ("autocast",)
    assert rows["loss_scale"].transforms == () and rows["gradients"].transforms == ()
    assert rows["wrap(eager)"].transforms == ("autocast",)  # TF32 for the call
    assert {r.runs for r in rows.values() if r.phase != "build"} == {"eager"}
    fp16 = ft.compile(ft.checkpoint(ft.autocast(ft.accumulate(step, 2), torch.float16)))
    rows = {r.hook: r for r in fp16.explain_rows()}
    assert rows["loss_scale"].transforms == ("autocast",) and rows["init"].runs == "eager"
    assert rows["forward"].transforms == ("checkpoint", "autocast")  # outermost first
    assert rows["forward"].runs == "compiled per micro-batch" and rows["split"].runs == "eager"
    assert rows["gradients"].runs == "compiled" and rows["wrap(compile)"].transforms == ("compile",)
    text = fp16.explain()
    assert text.splitlines()[0] == repr(fp16)
    assert [line.split()[1] for line in text.splitlines()[1:]] == [
        r.hook for r in fp16.explain_rows()
    ]
