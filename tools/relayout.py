"""Move ftrain's modules so that the package layout shows the architecture (issue 27, part 3).

    python tools/relayout.py          # from the repository root: git mv, then rewrite references
    python tools/relayout.py --dry    # say what would move; change nothing

Idempotent: a module already at its new place is not moved again, and no new name contains an
old one, so a second run changes nothing. It can be run again on a tree whose modules have
changed since (the moves are by module, the rewrites by full dotted or path name).

What it does, in order:

1. writes the new packages' ``__init__.py`` (a docstring saying what the package holds);
2. ``git mv`` of every module in :data:`MOVES` (a package moves with every file in it);
3. rewrites every reference in every file git knows (tracked or not ignored), this script
   excepted: ``from ftrain.x import y`` and ``import ftrain.x`` by their AST (a submodule
   imported from its package, ``from ftrain import rundir``, follows the module; a local name
   that changes with it is renamed where the file binds it nowhere else), then the text:
   dotted names (``ftrain.x.y``, ``ft.x.y``, in code, strings, docstrings, comments,
   ``monkeypatch.setattr("ftrain.x.y", ...)``), paths (``ftrain/x.py``, ``ftrain/recipes/``) in
   Markdown, notebooks (their JSON text; still valid JSON), benchmarks, tests, .ci and
   pyproject.toml, longest name first so that ``ftrain.io.checkpoint`` and
   ``ftrain.transforms.checkpoint`` never collide; and :data:`SYMBOLS`, names renamed in their
   module;
4. sorts the rewritten imports and formats the rewritten Python files with ruff.

Test files are not moved or renamed (another change mirrors tests/ from :data:`MOVES`).

Where each module goes, and why (one line each):

The app, in ``ftrain.app`` (the ``ftrain`` command; the library never imports it):
  ftrain.cli               -> ftrain.app.cli             the command's parser and dispatch
  ftrain.config            -> ftrain.app.config          the command's settings (TrainConfig)
  ftrain.loop              -> ftrain.app.loop            the command's training loop; its
                              ``evaluate`` is ``validation_loss`` (``ft.evaluate`` is public)
  ftrain.resume            -> ftrain.app.resume          ``--resume``: the state a run continues
  ftrain.rundir            -> ftrain.app.run_folder      what a run leaves in its folder
                              (config.json, metrics.jsonl, loss.png), apart from ftrain.io.runs
                              (a run's checkpoint-<step>/ series, in the library)
  ftrain.sinks             -> ftrain.app.sinks           where the command sends its numbers
  ftrain.process           -> ftrain.app.process         settings a training process applies
                              to itself (never the library)
  ftrain.export            -> ftrain.app.export          ``ftrain export``
  ftrain.run_settings      -> ftrain.app.run_settings    the settings a run saved
  ftrain.settings_file     -> ftrain.app.settings_file   reading ``--config``
  ftrain.recipes           -> ftrain.app.recipes         what the command trains, from its
                              settings (every module of the package moves with it)
  ftrain.memory.recipe     -> ftrain.app.recipes.memory_budget   ``--memory-budget``: the
                              recipe fitted with ``ft.fit``; it imports the app's config, so it
                              is the app's; named after its flag

Plumbing, in ``ftrain.internals`` (any ftrain module may import from it, private names too):
  ftrain.scoped            -> ftrain.internals.scoped         values set for a ``with`` block
  ftrain.func_scope        -> ftrain.internals.func_scope     inside a torch.func transform?
  ftrain.dynamo            -> ftrain.internals.dynamo         scoped dynamo settings, counters
  ftrain.modules           -> ftrain.internals.module_tables  nn.Module's internal tables
                              (``modules`` was one letter from ``ftrain.models``)
  ftrain.foreach           -> ftrain.internals.foreach        the _foreach kernels, looped
  ftrain.blocks            -> ftrain.internals.blocks         a model's blocks, rewritten copies
  ftrain.keyed_dropout     -> ftrain.internals.keyed_dropout  dropout drawn from a key
  ftrain.units             -> ftrain.internals.units          byte sizes read and written
  ftrain.version           -> ftrain.internals.version        ``ftrain.__version__``'s source
  ftrain.batch             -> ftrain.internals.batch          rows of a nested batch

``ftrain.distributed`` by kind of parallelism (launch, collectives, dtensor stay: both use them):
  ftrain.distributed.zero        -> ftrain.distributed.data_parallel.zero      ZeRO layouts
  ftrain.distributed.fsdp        -> ftrain.distributed.data_parallel.fsdp      FSDP's gathering
  ftrain.distributed.dp_split    -> ftrain.distributed.data_parallel.dp_split  ZeRO/FSDP over dp
                                    of a tensor-parallel state
  ftrain.distributed.owners      -> ftrain.distributed.data_parallel.owners    whole-tensor
                                    functions on row shards (Muon under ZeRO)
  ftrain.distributed.plans       -> ftrain.distributed.tensor_parallel.plans   "plan" now means
                                    only this: which layers split how (torch's parallelize_plan)
  ftrain.distributed.tp          -> ftrain.distributed.tensor_parallel.linear  column/row
                                    parallel linears and their f/g collectives
  ftrain.distributed.tp_layout   -> ftrain.distributed.tensor_parallel.mesh    the (dp, tp)
                                    mesh and where a state's tensors sit on it (not a "layout")
  ftrain.distributed.tp_model    -> ftrain.distributed.tensor_parallel.model   the model copy a
                                    tensor-parallel forward runs
  ftrain.distributed.tp_sequence -> ftrain.distributed.tensor_parallel.sequence_region   the
                                    modules a plan marks sequence-parallel, wired
  ftrain.distributed.sequence    -> ftrain.distributed.tensor_parallel.sequence   sequence
                                    parallelism's collectives and layers
  ftrain.distributed.vocab       -> ftrain.distributed.tensor_parallel.vocab_loss   the loss
                                    over vocabulary-split logits (the module is a loss)

One name, one idea:
  ftrain.transforms.checkpoint   -> ftrain.transforms.recompute   ``ft.checkpoint`` recomputes
                                    activations; ``ftrain.io.checkpoint`` saves
  ftrain.optim.transforms        -> ftrain.optim.primitives       the optimizer's building
                                    blocks, apart from ``ftrain.transforms`` (Step -> Step)
  ftrain.step.record             -> ftrain.step.core              where ``Step`` is defined and
                                    run; the package's other modules plug into it
  ftrain.io.layout               -> ftrain.io.state_files         which file and JSON entry
                                    each tensor of a state goes to
  ftrain.memory.layout           -> ftrain.memory.one_rank        ``ft.shard`` as one rank runs
                                    it under the planner: its rows, its side of each collective
  ftrain.memory.fsdp             -> ftrain.memory.fake_fsdp       the fsdp step on fake shards
                                    (``ftrain.distributed.data_parallel.fsdp`` is the real one)
  ftrain.memory.plan             -> ftrain.memory.predict         ``ft.memory``'s prediction
                                    ("plan" is the tensor-parallel plan's word)

The ftrain/ root keeps the public library: __init__, __main__, apply, evaluate, losses,
per_example, rng, stack, state, testing, tree (11 modules).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

# Old module -> new module (dotted). A package moves with every module in it; its modules are
# listed too, so that this dict is the whole mapping (tests/ mirrors it).
MOVES: dict[str, str] = {
    # the app
    "ftrain.cli": "ftrain.app.cli",
    "ftrain.config": "ftrain.app.config",
    "ftrain.loop": "ftrain.app.loop",
    "ftrain.resume": "ftrain.app.resume",
    "ftrain.rundir": "ftrain.app.run_folder",
    "ftrain.sinks": "ftrain.app.sinks",
    "ftrain.process": "ftrain.app.process",
    "ftrain.export": "ftrain.app.export",
    "ftrain.run_settings": "ftrain.app.run_settings",
    "ftrain.settings_file": "ftrain.app.settings_file",
    "ftrain.recipes": "ftrain.app.recipes",
    "ftrain.recipes.corpus": "ftrain.app.recipes.corpus",
    "ftrain.recipes.finetune": "ftrain.app.recipes.finetune",
    "ftrain.recipes.gpt": "ftrain.app.recipes.gpt",
    "ftrain.recipes.hf": "ftrain.app.recipes.hf",
    "ftrain.recipes.placement": "ftrain.app.recipes.placement",
    "ftrain.recipes.rows": "ftrain.app.recipes.rows",
    "ftrain.recipes.startup": "ftrain.app.recipes.startup",
    "ftrain.memory.recipe": "ftrain.app.recipes.memory_budget",
    # plumbing
    "ftrain.scoped": "ftrain.internals.scoped",
    "ftrain.func_scope": "ftrain.internals.func_scope",
    "ftrain.dynamo": "ftrain.internals.dynamo",
    "ftrain.modules": "ftrain.internals.module_tables",
    "ftrain.foreach": "ftrain.internals.foreach",
    "ftrain.blocks": "ftrain.internals.blocks",
    "ftrain.keyed_dropout": "ftrain.internals.keyed_dropout",
    "ftrain.units": "ftrain.internals.units",
    "ftrain.version": "ftrain.internals.version",
    "ftrain.batch": "ftrain.internals.batch",
    # distributed, by kind of parallelism
    "ftrain.distributed.zero": "ftrain.distributed.data_parallel.zero",
    "ftrain.distributed.fsdp": "ftrain.distributed.data_parallel.fsdp",
    "ftrain.distributed.dp_split": "ftrain.distributed.data_parallel.dp_split",
    "ftrain.distributed.owners": "ftrain.distributed.data_parallel.owners",
    "ftrain.distributed.plans": "ftrain.distributed.tensor_parallel.plans",
    "ftrain.distributed.tp": "ftrain.distributed.tensor_parallel.linear",
    "ftrain.distributed.tp_layout": "ftrain.distributed.tensor_parallel.mesh",
    "ftrain.distributed.tp_model": "ftrain.distributed.tensor_parallel.model",
    "ftrain.distributed.tp_sequence": "ftrain.distributed.tensor_parallel.sequence_region",
    "ftrain.distributed.sequence": "ftrain.distributed.tensor_parallel.sequence",
    "ftrain.distributed.vocab": "ftrain.distributed.tensor_parallel.vocab_loss",
    # one name, one idea
    "ftrain.transforms.checkpoint": "ftrain.transforms.recompute",
    "ftrain.optim.transforms": "ftrain.optim.primitives",
    "ftrain.step.record": "ftrain.step.core",
    "ftrain.io.layout": "ftrain.io.state_files",
    "ftrain.memory.layout": "ftrain.memory.one_rank",
    "ftrain.memory.fsdp": "ftrain.memory.fake_fsdp",
    "ftrain.memory.plan": "ftrain.memory.predict",
}

# (new module, old name) -> new name: names renamed in the module that defines them.
SYMBOLS: dict[tuple[str, str], str] = {
    ("ftrain.app.loop", "evaluate"): "validation_loss",  # beside ft.evaluate; not cfg.validate
}

# Bare old module names that prose (docstrings, comments, Markdown) uses alone, and what to write.
PROSE: dict[str, str] = {
    "rundir": "run_folder",
    "tp_layout": "tensor_parallel.mesh",
    "tp_model": "tensor_parallel.model",
    "tp_sequence": "tensor_parallel.sequence_region",
}

NEW_PACKAGES: dict[str, str] = {
    "ftrain.app": """The ``ftrain`` command, built on the library: its settings (``config``, ``run_settings``,
``settings_file``), its loop (``loop``, ``resume``), what a run writes (``run_folder``, ``sinks``,
``export``), the process settings it applies to itself (``process``) and the recipes that build
what it trains (``recipes``). Nothing in the library imports this package; ``python -m ftrain``
and the ``ftrain`` console script run ``ftrain.app.cli.main``.""",
    "ftrain.internals": """Plumbing that ftrain's modules share and users do not call: scoped values
(``scoped``, ``func_scope``), ``torch._dynamo`` settings (``dynamo``), nn.Module's tables
(``module_tables``), multi-tensor kernels (``foreach``), block rewriting (``blocks``), keyed
dropout, byte units, batch rows and the version. Any ftrain module may import from here, private
names included (tests/test_structure.py allows exactly that); nothing here is public API.""",
    "ftrain.distributed.data_parallel": """Data parallelism (``ft.shard``): what each process keeps
under ddp, zero1, zero2 and fsdp (``zero``), fsdp's per-block gathering (``fsdp``), the split over
``dp`` of a tensor-parallel state (``dp_split``) and whole-tensor functions computed once on an
owner rank (``owners``). ``ftrain.distributed`` re-exports the public names.""",
    "ftrain.distributed.tensor_parallel": """Tensor parallelism (``ft.tensor_parallel``): plans
(``plans``: which layers split by columns or rows), the ``(dp, tp)`` mesh and where a state's
tensors sit on it (``mesh``), the column/row-parallel linears (``linear``), the model copy a
forward runs (``model``), sequence parallelism (``sequence``, wired in by ``sequence_region``) and
the vocabulary-parallel loss (``vocab_loss``). ``ftrain.distributed`` re-exports the public
names.""",
}

# ftrain/distributed/__init__.py's first lines, as they read before the move, and after.
DISTRIBUTED_DOC = (
    '"""Data and tensor parallelism on ``torch.distributed``: process-group set-up, flat '
    "collectives,\nDTensor plumbing, ZeRO state layouts, FSDP gathering, tensor-parallel plans, "
    "layouts and model\ncopies, and the split over ``dp`` of a tensor-parallel state "
    "(``dp_split``).",
    '"""Data and tensor parallelism on ``torch.distributed``: what both use here (process-group '
    "set-up\n(``launch``), flat collectives (``collectives``), DTensor plumbing (``dtensor``)), "
    "data parallelism\nin ``data_parallel`` (ZeRO layouts, FSDP gathering, the split over ``dp`` "
    "of a tensor-parallel\nstate) and tensor parallelism in ``tensor_parallel`` (plans, the mesh, "
    "model copies, sequence\nparallelism, the vocabulary-parallel loss).",
)

TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ""}
SELF = Path("tools/relayout.py")


def say(*args) -> None:
    print("relayout:", *args)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def module_path(module: str, root: Path) -> Path:
    """The file of a dotted module: ``a/b.py``, or ``a/b/__init__.py`` for a package."""
    base = root.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def full_map(root: Path) -> dict[str, str]:
    """MOVES, plus every module found under a moved package that MOVES does not name (one a later
    change added), found at the package's old or new place."""
    out = dict(MOVES)
    for old, new in MOVES.items():
        for where in (root.joinpath(*old.split(".")), root.joinpath(*new.split("."))):
            if not (where / "__init__.py").exists():
                continue
            for f in where.rglob("*.py"):
                rel = f.relative_to(where).with_suffix("").parts
                rel = rel[:-1] if rel[-1] == "__init__" else rel
                if rel:
                    sub = ".".join(rel)
                    out.setdefault(f"{old}.{sub}", f"{new}.{sub}")
    for new in out.values():
        assert not any(re.search(rf"(?<![\w.]){re.escape(o)}(?!\w)", new) for o in out), (
            f"{new} contains an old name: a second run would move it again"
        )
    return out


def map_module(module: str, mapping: dict[str, str]) -> str:
    """The new name of ``module`` or of the longest moved package holding it."""
    for old in sorted(mapping, key=len, reverse=True):
        if module == old or module.startswith(old + "."):
            return mapping[old] + module[len(old) :]
    return module


# --- 1 and 2: packages and moves ---------------------------------------------------------------


def write_packages(root: Path, dry: bool) -> None:
    for package, doc in NEW_PACKAGES.items():
        init = root.joinpath(*package.split("."), "__init__.py")
        if init.exists():
            continue
        say("new package", package)
        if not dry:
            init.parent.mkdir(parents=True, exist_ok=True)
            text = textwrap.fill('"""' + " ".join(doc.split()), WIDTH, break_on_hyphens=False)
            init.write_text(f'{text}\n"""\n')
            git("add", str(init))


def move(root: Path, dry: bool) -> None:
    for old, new in MOVES.items():
        old_base, new_base = root.joinpath(*old.split(".")), root.joinpath(*new.split("."))
        src = old_base if old_base.is_dir() else old_base.with_suffix(".py")
        dst = new_base if old_base.is_dir() else new_base.with_suffix(".py")
        if not src.exists():
            if not (new_base.is_dir() or new_base.with_suffix(".py").exists()):
                say(f"skipped {old}: neither it nor {new} exists")
            continue
        if dst.is_dir() and not any(
            f.is_file() and "__pycache__" not in f.parts for f in dst.rglob("*")
        ):
            shutil.rmtree(dst)  # only caches left from an earlier run
        if dst.exists():
            raise SystemExit(f"relayout: both {src} and {dst} exist; move one of them by hand")
        say(f"git mv {src.relative_to(root)} {dst.relative_to(root)}")
        if not dry:
            dst.parent.mkdir(parents=True, exist_ok=True)
            git("mv", str(src), str(dst))


# --- 3: rewrites ---------------------------------------------------------------------------------


class Source:
    """A file's text, edited at AST positions (line, column in UTF-8 bytes), applied at once."""

    def __init__(self, text: str):
        self.text = text
        # by "\n" alone, as the parser counts lines (str.splitlines also cuts at \f, \x1c, ...)
        self.lines = [line + "\n" for line in text.split("\n")]
        self.lines[-1] = self.lines[-1][:-1]
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.edits: list[tuple[int, int, str]] = []

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + len(self.lines[line - 1].encode()[:col].decode())

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),
            self.offset(node.end_lineno, node.end_col_offset),
        )

    def replace(self, start: int, end: int, new: str) -> None:
        self.edits.append((start, end, new))

    def result(self) -> str:
        out, last = [], 0
        for start, end, new in sorted(self.edits):
            assert start >= last, "overlapping edits"
            out += [self.text[last:start], new]
            last = end
        return "".join(out) + self.text[last:]


def package_bindings(package: str, mapping: dict[str, str], root: Path) -> set[str]:
    """Names a package's ``__init__`` binds other than by importing its own submodule by name:
    ``from ftrain.transforms import checkpoint`` is the function, not the module."""
    init = module_path(map_module(package, mapping), root)
    if init.name != "__init__.py" or not init.exists():
        return set()
    names = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.module in (package, map_module(package, mapping)):
                continue
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def bound_names(tree: ast.AST, skip: tuple[str, str] | None = None) -> set[str]:
    """Every name the module binds anywhere (assignments, arguments, defs, imports, handlers),
    except by ``from skip[0] import skip[1]``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and skip and node.module == skip[0]:
            out.update(a.asname or a.name for a in node.names if a.name != skip[1] or a.asname)
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out.update(node.names)
    return out


def rewrite_python(
    text: str, here: str | None, mapping: dict[str, str], root: Path, where: str
) -> str:
    """Imports by their AST, local names that change with them, and SYMBOLS where defined."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        say(f"{where}: not Python 3 source; only its text is rewritten")
        return text
    src = Source(text)
    renames: dict[str, str] = {}  # local name -> new local name
    all_names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | bound_names(tree)
    bindings_cache: dict[str, set[str]] = {}

    def rename_local(old: str, new: str, node: ast.ImportFrom) -> str | None:
        """Rename ``old`` to ``new`` in the file; None (keep ``as old``) where that is unsafe."""
        if old in bound_names(tree, skip=(node.module, old)) or new in all_names:
            say(f"{where}: kept the local name {old!r} (`as {old}`): the file binds it elsewhere")
            return None
        if renames.get(old, new) != new:
            return None
        renames[old] = new
        return new

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not (node.module == "ftrain" or node.module.startswith("ftrain.")):
                continue
            if node.module not in bindings_cache:
                bindings_cache[node.module] = package_bindings(node.module, mapping, root)
            groups: dict[str, list[str]] = {}
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in mapping and a.name not in bindings_cache[node.module]:
                    parent, _, name = mapping[full].rpartition(".")
                else:
                    parent = map_module(node.module, mapping)
                    name = SYMBOLS.get((parent, a.name), a.name)
                asname = a.asname
                if name != a.name and asname is None and not rename_local(a.name, name, node):
                    asname = a.name
                groups.setdefault(parent, []).append(f"{name} as {asname}" if asname else name)
            new_module = map_module(node.module, mapping)
            same_names = list(groups) == [new_module] and groups[new_module] == [
                f"{a.name} as {a.asname}" if a.asname else a.name for a in node.names
            ]
            start, end = src.span(node)
            if same_names:
                if new_module != node.module:
                    head = f"from {node.module}"
                    assert text[start : start + len(head)] == head, (where, node.lineno)
                    src.replace(start, start + len(head), f"from {new_module}")
                continue
            segment = text[start:end]
            if "#" in segment:
                say(f"{where}:{node.lineno}: comments inside the import are dropped; check it")
            indent = "\n" + " " * node.col_offset
            src.replace(
                start,
                end,
                indent.join(f"from {m} import {', '.join(ns)}" for m, ns in groups.items()),
            )
        elif isinstance(node, ast.Import):
            for a in node.names:
                new = map_module(a.name, mapping) if a.name.startswith("ftrain.") else a.name
                if new != a.name:
                    start, end = src.span(a)
                    src.replace(start, start + len(a.name), new)

    # the local names that changed, and SYMBOLS in the module that defines them
    defined = {old: new for (module, old), new in SYMBOLS.items() if module == here}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in renames:
            start, end = src.span(node)
            if text[start:end] == node.id:
                src.replace(start, end, renames[node.id])
            else:
                say(f"{where}:{node.lineno}: could not place {node.id!r}; rename it by hand")
        elif defined and isinstance(node, ast.Name) and node.id in defined:
            start, end = src.span(node)
            src.replace(start, end, defined[node.id])
        elif defined and isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in defined:
            line = src.lines[node.lineno - 1]
            col = line.index(
                node.name, line.index("def " if isinstance(node, ast.FunctionDef) else "class ")
            )
            start = src.starts[node.lineno - 1] + col
            src.replace(start, start + len(node.name), defined[node.name])
        elif defined and isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            for item in getattr(node.value, "elts", []):
                if isinstance(item, ast.Constant) and item.value in defined:
                    start, end = src.span(item)
                    src.replace(start, end, repr(defined[item.value]).replace("'", '"'))
    return src.result()


def dotted_pattern(mapping: dict[str, str]) -> tuple[re.Pattern, dict[str, str]]:
    """One regex for every old dotted name (``ftrain.x.y``, or ``ft.x.y`` past the root), longest
    first; a name may be cut by a line break after a dot, as in a wrapped docstring."""
    table = dict(mapping)
    for (module, old), new in SYMBOLS.items():
        before = next((o for o, n in mapping.items() if n == module), module)
        table[f"{before}.{old}"] = f"{module}.{new}"
    keys = sorted((k.split(".", 1)[1] for k in table), key=len, reverse=True)
    alt = "|".join(r"\.(?:\n[ \t]*)?".join(map(re.escape, k.split("."))) for k in keys)
    pattern = re.compile(rf"(?<![\w.])(ftrain|ft)\.({alt})(?!\w)")
    return pattern, {k.split(".", 1)[1]: v.split(".", 1)[1] for k, v in table.items()}


def rewrite_text(
    text: str, mapping: dict[str, str], prose_spans: list[tuple[int, int]] | None
) -> str:
    """Dotted names and paths everywhere; PROSE words only inside ``prose_spans`` (strings and
    comments of a Python file), or everywhere when that is None (Markdown)."""
    out = text
    if PROSE:
        words = re.compile(rf"(?<![\w./])({'|'.join(map(re.escape, PROSE))})(?!\w)")
        if prose_spans is None:
            out = words.sub(lambda m: PROSE[m.group(0)], out)
        else:
            out = apply_in_spans(out, words, prose_spans)
    pattern, table = dotted_pattern(mapping)

    def dotted(m: re.Match) -> str:
        key = re.sub(r"\s+", "", m.group(2))
        if m.group(1) == "ft" and "." not in key:
            return m.group(0)  # ft.x is an attribute of the package, not a module
        return f"{m.group(1)}.{table[key]}"

    out = pattern.sub(dotted, out)
    for old in sorted(mapping, key=len, reverse=True):
        old_path, new_path = old.replace(".", "/"), mapping[old].replace(".", "/")
        out = re.sub(rf"(?<![\w.]){re.escape(old_path)}(?=\.py\b|/|(?!\w))", new_path, out)
    return out


def apply_in_spans(text: str, words: re.Pattern, spans: list[tuple[int, int]]) -> str:
    pieces, last = [], 0
    for start, end in spans:
        pieces += [text[last:start], words.sub(lambda m: PROSE[m.group(0)], text[start:end])]
        last = end
    return "".join(pieces) + text[last:]


def prose_spans(text: str) -> list[tuple[int, int]]:
    """Where the strings and comments of a Python source are (character offsets)."""
    src = Source(text)
    spans = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                (l1, c1), (l2, c2) = tok.start, tok.end
                spans.append((src.starts[l1 - 1] + c1, src.starts[l2 - 1] + c2))
    except (tokenize.TokenError, IndentationError):
        return []
    return spans


def module_of(path: Path, root: Path) -> str | None:
    rel = path.relative_to(root)
    if rel.parts[0] != "ftrain" or rel.suffix != ".py":
        return None
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rewrite_all(root: Path, mapping: dict[str, str]) -> dict[Path, str]:
    files = git("ls-files", "-co", "--exclude-standard").splitlines()
    changed = {}  # path -> its text before
    for name in sorted(set(files)):
        path = root / name
        if Path(name) == SELF or not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = text
        if path.suffix == ".py":
            new = rewrite_python(new, module_of(path, root), mapping, root, name)
            new = rewrite_text(new, mapping, prose_spans(new))
        elif path.suffix == ".ipynb":
            new = rewrite_text(new, mapping, [])
            json.loads(new)  # still a notebook
        else:
            new = rewrite_text(new, mapping, None if path.suffix == ".md" else [])
        if name == "ftrain/distributed/__init__.py" and DISTRIBUTED_DOC[0] in new:
            new = new.replace(DISTRIBUTED_DOC[0], DISTRIBUTED_DOC[1])
        if new != text:
            path.write_text(new)
            changed[path] = text
    return changed


def tidy(paths: list[Path]) -> None:
    """Sort the rewritten imports and format the rewritten Python files."""
    py = [str(p) for p in paths if p.suffix == ".py"]
    ruff = shutil.which("ruff") or None
    if not py:
        return
    if ruff is None:
        say("ruff not found: run `ruff check --select I --fix` and `ruff format` on", *py)
        return
    subprocess.run([ruff, "check", "--select", "I", "--fix", "--quiet", *py], check=False)
    subprocess.run([ruff, "format", "--quiet", *py], check=True)


WIDTH = 100  # the project's line length (pyproject.toml)
MARKERS = re.compile(r"(-|\*|\+|>>>|\.\.|:|=|\||#|\d+\.|```|\"\"\"|$)")


def prose_lines(text: str, suffix: str) -> set[int]:
    """Indices of the lines that are prose: a Python file's docstrings (not other strings: they
    are data) and full-line comments; a Markdown file's paragraphs (not code, tables, headings)."""
    lines = text.split("\n")
    out = set()
    if suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                if isinstance(node.value.value, str):
                    out.update(range(node.lineno - 1, node.end_lineno))
        out.update(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    elif suffix == ".md":
        fence = False
        for i, line in enumerate(lines):
            if line.lstrip().startswith("```"):
                fence = not fence
            elif not fence and not line.startswith(("    ", "|", "#", "\t")) and line.strip():
                out.add(i)
    return out


def rewrap(path: Path, before: str) -> int:
    """Lines the rewrite made longer than WIDTH, wrapped: the words past WIDTH move to the start
    of the next line of the same paragraph (which may in turn overflow), or to a new line.
    Lines that were already long, code, tables and data strings are left as they are."""
    text = path.read_text()
    if path.suffix not in (".py", ".md"):
        return 0
    prose, old = prose_lines(text, path.suffix), set(before.split("\n"))
    lines, wrapped, i = text.split("\n"), 0, 0
    carry = False  # the line holds words moved down from the one above
    while i < len(lines):
        line = lines[i]
        if len(line) <= WIDTH or i not in prose or (line in old and not carry):
            i, carry = i + 1, False
            continue
        comment = re.match(r"\s*# ?", line) if path.suffix == ".py" else None
        lead = comment.group(0) if comment and line.lstrip().startswith("#") else None
        body_start = len(lead) if lead else len(line) - len(line.lstrip())
        cut = line.rfind(" ", body_start + 1, WIDTH + 1)
        if cut <= body_start:
            i, carry = i + 1, False
            continue
        head, rest = line[:cut].rstrip(), line[cut + 1 :]
        nxt = lines[i + 1] if i + 1 < len(lines) else None
        indent = lead if lead else " " * (len(line) - len(line.lstrip()))
        if lead is None and line.lstrip().startswith('"""'):
            indent = " " * (len(line) - len(line.lstrip()))
        joinable = (
            nxt is not None
            and i + 1 in prose
            and nxt.strip()
            and (nxt.startswith(lead) if lead else not nxt.lstrip().startswith("#"))
            and not MARKERS.match(nxt[len(lead) :] if lead else nxt.lstrip())
            and (lead is not None or len(nxt) - len(nxt.lstrip()) == len(indent))
        )
        lines[i] = head
        if joinable:
            stripped = nxt[len(lead) :] if lead else nxt.lstrip()
            lines[i + 1] = f"{indent}{rest} {stripped}"
        else:
            lines.insert(i + 1, f"{indent}{rest}")
            prose = {j + 1 if j > i else j for j in prose} | {i + 1}
        wrapped += 1
        i, carry = i + 1, True
    if wrapped:
        path.write_text("\n".join(lines))
    return wrapped


# --- checks after ---------------------------------------------------------------------------------


def leftovers(root: Path, mapping: dict[str, str]) -> list[str]:
    """Lines that still name an old module by its dotted name or path."""
    found = []
    for name in git("ls-files", "-co", "--exclude-standard").splitlines():
        path = root / name
        if Path(name) == SELF or not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if rewrite_text(line, mapping, []) != line:
                found.append(f"{name}:{i}: {line.strip()[:120]}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="say what would move; change nothing")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if not (root / "ftrain" / "__init__.py").exists() or not (root / ".git").exists():
        raise SystemExit("relayout: run it from the repository root (the folder holding ftrain/)")
    for old in MOVES:
        inside = any(old.startswith(package + ".") for package in MOVES)  # moves with its package
        assert inside or old in __doc__, f"{old} is moved but not argued in the docstring"
    write_packages(root, args.dry)
    move(root, args.dry)
    if args.dry:
        return 0
    mapping = full_map(root)
    changed = rewrite_all(root, mapping)
    tidy(list(changed))
    wrapped = sum(rewrap(path, before) for path, before in changed.items())
    say(f"rewrote {len(changed)} files; wrapped {wrapped} lines the longer names made too long")
    loose = sorted(p.name for p in (root / "ftrain").glob("*.py"))
    say(f"ftrain/ root: {len(loose)} modules: {' '.join(loose)}")
    if len(loose) > 12:
        say("more than 12 modules at the root: place the new ones in MOVES")
    left = leftovers(root, mapping)
    for line in left:
        say("old name left:", line)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
