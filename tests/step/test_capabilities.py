"""ftrain.step.capabilities: what a transform declares, checked against one table when the step is
built. A capability is exclusive unless the table shares it; a rule names both transforms and the
fix, in either order; no built-in transform names another."""

import pytest

import ftrain as ft
from ftrain.step import capabilities

from _tiny import gpt_step


class GradNoise(ft.Transform):
    def capabilities(self):
        return {"adds gradient noise": ""}


class OtherNoise(ft.Transform):
    def capabilities(self):
        return {"adds gradient noise": "another kind"}


def test_a_declared_capability_is_exclusive_unless_the_table_shares_it():
    _, step, _ = gpt_step()
    assert GradNoise.name == "grad_noise"  # the class name in snake case
    with pytest.raises(ValueError, match=r"^ft\.grad_noise was applied twice \(it adds gradient "):
        GradNoise()(ft.accumulate(GradNoise()(step), 2))
    for build in (lambda: OtherNoise()(GradNoise()(step)), lambda: GradNoise()(OtherNoise()(step))):
        with pytest.raises(
            ValueError, match=r"adds gradient noise.*and so does.*Apply one of them"
        ):
            build()
    shared = capabilities.SAVED_TENSOR_HOOKS  # two transforms may both use saved-tensor hooks

    class Hooks(ft.Transform):
        def capabilities(self):
            return {shared: ""}

    assert Hooks()(ft.checkpoint(step)).names == ("checkpoint", "hooks")


class FuncGrad(ft.Transform):
    def capabilities(self):
        return {capabilities.TORCH_FUNC_GRADIENTS: ""}


def test_a_rule_of_the_table_names_both_transforms_and_the_fix_in_either_order():
    _, step, _ = gpt_step()
    for build in (lambda: ft.checkpoint(FuncGrad()(step)), lambda: FuncGrad()(ft.checkpoint(step))):
        with pytest.raises(ValueError) as refused:
            build()
        message = str(refused.value)
        assert message.startswith("ft.func_grad computes gradients with torch.func and ")
        assert "ft.checkpoint uses saved-tensor hooks" in message
        assert "torch.func refuses saved-tensor hooks" in message and "Leave out" in message
    assert FuncGrad()(ft.checkpoint(step, policy="none")).names == ("checkpoint", "func_grad")
    for rule in capabilities.RULES:  # every rule's capabilities are ones the module defines
        assert {rule.a, rule.b} <= {getattr(capabilities, n) for n in capabilities.__all__}


# -- the built-ins have no privileges ------------------------------------------------------------


def test_no_builtin_transform_names_another():
    """Which transforms combine is declared and checked in one table: no module of
    ``ftrain.transforms`` imports another's class or compares transform names."""
    import ast
    from pathlib import Path

    import ftrain.transforms

    folder = Path(ftrain.transforms.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    for path in sorted(folder.glob("*.py")):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                assert not (parts[:2] == ["ftrain", "transforms"] and parts[2:3] != [path.stem]), (
                    f"{path.name} imports {node.module}"
                )
                if node.module == "ftrain.transforms":
                    assert not {a.name for a in node.names} & modules, path.name
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute):
                assert node.left.attr != "name", f"{path.name}:{node.lineno} compares a name"


def test_gradients_are_final_after_backward_unless_a_transform_reduces_them_after():
    """Only a transform reducing in backward (fsdp) leaves the engine's gradients final; its own
    reduce hook is trusted to change only what the engine left local (its contract)."""
    caps = capabilities

    def declaring(*names, reduces=False):
        class T(ft.Transform):
            def capabilities(self):
                return dict.fromkeys(names, "")

        if reduces:
            T.reduce = lambda self, grads, sums: (grads, sums)
        return T()

    fsdp = declaring(caps.DATA_PARALLEL, caps.REDUCES_IN_BACKWARD, reduces=True)
    zero2 = declaring(caps.DATA_PARALLEL, reduces=True)
    tp = declaring(caps.DATA_PARALLEL_OVER)
    summing = declaring(reduces=True)  # a reduce hook of its own, in one process
    after = caps.reduced_after_backward
    assert not after([], []) and not after([fsdp], [fsdp])
    assert after([zero2], [zero2]) and after([summing], [summing])
    assert after([fsdp, tp], [fsdp])  # tp's params whole over dp: all-reduced by fsdp's reduce
    assert after([fsdp, summing], [fsdp, summing])
