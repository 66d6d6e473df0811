"""Every Python call the docs quote names a moe_lit function or class that accepts it as quoted.

A quoted call is an inline code span that is a call (``dense_to_moe(model, "granular", E, k,
granularity=G)``, ``moe_lit.lit.run.train_run(model_cfg, run, ...)``, ``Transformer.routing_stats()``)
or any call in a fenced ``python`` block; every ``from moe_lit... import`` anywhere in a doc (blocks,
``python -c`` lines) and every inline ``moe_lit.a.b`` name must import. A callee resolves by its dotted
path (``moe_lit.x.y``), else by the moe_lit class or module its first part names (``RunConfig.from_experiment``,
``moe_to_dense.grid``), else as a function, class or method moe_lit defines (found in the source, without
importing it), else as a variable of the block (``beats = Claim(...)``; ``beats.on(...)``; one that another library's
call returns is that library's) or a placeholder
of :data:`INSTANCES` (``model(idx, targets)``). The call must bind to the signature: its keywords exist, no more
positional arguments than it takes, none given twice (``...`` stands for arguments left out, ``a|b`` for
alternatives). A callee of another library is listed in :data:`NOT_OURS`; any other name fails.
"""

import ast
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from tests.helpers.doc_commands import DOCS
from tests.helpers.paths import REPO

NOT_OURS = {
    "torch": "torch's API",
    "AutoModelForCausalLM": "transformers",
    "AutoTokenizer": "transformers",
    "TaskManager": "lm-eval",
    "Shard": "torch.distributed.tensor placements",
    "len": "a builtin",
    "print": "a builtin",
    "sqrt": "arithmetic in a formula",
    "fn": "a function the reader writes",
}
"""First names of callees that are not moe_lit's, and whose they are."""
INSTANCES = {
    "model": "moe_lit.model.transformer.Transformer",
    "header": "moe_lit.studies.study.StudyHeader",
    "recorder": "moe_lit.evaluation.routing_trace.TraceRecorder",
    "trace": "moe_lit.evaluation.routing_trace.RoutingTrace",
}
"""Names the docs use for an instance of a moe_lit class (``model(idx, targets)``, ``header.start(...)``)."""
_FENCE = re.compile(r"^\s*```(\w*)")
_SPAN = re.compile(r"`([^`]+)`")
_CALL_SPAN = re.compile(r"^[A-Za-z_][\w.]*\(.*\)(\.\w+\(.*\))*$", re.DOTALL)
_NAME_SPAN = re.compile(r"^moe_lit(\.\w+)+$")
_IMPORT = re.compile(r"from (moe_lit[\w.]*) import ([\w, ]+)|import (moe_lit[\w.]*)")


@dataclass(frozen=True)
class Quoted:
    """A piece of Python a doc quotes: an inline span, or a whole ``python`` block."""

    where: str
    code: str
    block: bool

    def __str__(self) -> str:
        return f"{self.where}: {self.code}"


@dataclass(frozen=True)
class Instance:
    """An instance of ``cls``: its attributes are the class's, and calling it calls ``forward`` / ``__call__``."""

    cls: type


def quoted_python(doc: str) -> list[Quoted]:
    """The inline code spans (whitespace collapsed) and the ``python`` blocks of ``doc``, in order."""
    found, prose, block, fence = [], [], [], None
    lines = (REPO / doc).read_text().splitlines()
    for number, line in enumerate(lines, 1):
        opened = _FENCE.match(line)
        if opened and fence is None:
            fence, start, block = opened.group(1) or "text", number, []
        elif opened:
            if fence == "python":
                found.append(Quoted(f"{doc}:{start}", "\n".join(block), block=True))
            fence = None
        elif fence is not None:
            block.append(line)
        else:
            prose.append((number, line))
    text = "\n".join(line for _, line in prose)
    for span in _SPAN.finditer(text):
        number = prose[text.count("\n", 0, span.start())][0]
        found.append(Quoted(f"{doc}:{number}", " ".join(span.group(1).split()), block=False))
    return found


QUOTED = [q for doc in DOCS for q in quoted_python(doc)]
CALLS = [q for q in QUOTED if q.block or _CALL_SPAN.match(q.code)]


@cache
def definitions() -> dict[str, list[tuple[str, ...]]]:
    """Every function, class and method moe_lit defines, and every module, by its bare name:
    ``name -> [(module,), (module, name), (module, class, name), ...]`` (read from the source)."""
    found: dict[str, list[tuple[str, ...]]] = {}
    for path in sorted((REPO / "moe_lit").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found.setdefault(module.rsplit(".", 1)[-1], []).append((module,))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found.setdefault(node.name, []).append((module, node.name))
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not item.name.startswith("_"):
                        found.setdefault(item.name, []).append((module, node.name, item.name))
    return found


def dotted(path: str) -> Any:
    """The object a dotted ``moe_lit.a.b.c`` names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def candidates(expr: ast.expr, env: dict[str, Any]) -> list[Any]:
    """What ``expr`` (a callee or its owner) may be: objects, or :class:`Instance` of a class;
    an empty list for another library's; a LookupError when moe_lit defines no such name."""
    if isinstance(expr, ast.Name):
        if expr.id in env:
            return [] if env[expr.id] is None else [env[expr.id]]
        if expr.id in NOT_OURS:
            return []
        if expr.id in INSTANCES:
            return [Instance(dotted(INSTANCES[expr.id]))]
        if expr.id == "moe_lit":
            return [importlib.import_module("moe_lit")]
        places = definitions().get(expr.id)
        if not places:
            raise LookupError(f"moe_lit defines no {expr.id}")
        return [defined(place) for place in places]
    if isinstance(expr, ast.Attribute):
        owners = candidates(expr.value, env)
        found = [attribute(owner, expr.attr) for owner in owners]
        if owners and not any(f is not None for f in found):
            raise LookupError(f"no {expr.attr} on {', '.join(map(name_of, owners))}")
        return [f for f in found if f is not None]
    if isinstance(expr, ast.Call):
        return [Instance(c) for c in candidates(expr.func, env) if isinstance(c, type)]
    return []


def defined(place: tuple[str, ...]) -> Any:
    """The module, function or class of a :func:`definitions` entry, or its :class:`Method`."""
    module = importlib.import_module(place[0])
    if len(place) == 3:
        return Method(getattr(module, place[1]), place[2])
    return getattr(module, place[1]) if len(place) == 2 else module


@dataclass(frozen=True)
class Method:
    """A method looked up on a class and called on an instance (its ``self`` is implicit)."""

    cls: type
    name: str


def attribute(owner: Any, attr: str) -> Any:
    """``owner.attr``: a :class:`Method` for a plain function of a class, else the attribute or
    submodule (None if absent)."""
    package = inspect.ismodule(owner) and hasattr(owner, "__path__")
    if package and importlib.util.find_spec(f"{owner.__name__}.{attr}") is not None:
        return importlib.import_module(f"{owner.__name__}.{attr}")  # the submodule, not a name it exports
    cls = owner.cls if isinstance(owner, Instance) else owner
    if isinstance(cls, type):
        static = inspect.getattr_static(cls, attr, None)
        if inspect.isfunction(static):
            return Method(cls, attr)
    return getattr(cls, attr, None)


def name_of(obj: Any) -> str:
    if isinstance(obj, Instance | Method):
        return obj.cls.__qualname__ + (f".{obj.name}" if isinstance(obj, Method) else " instance")
    return getattr(obj, "__qualname__", repr(obj))


def signature(obj: Any) -> inspect.Signature:
    """The signature a call of ``obj`` binds to (an instance's ``forward`` / ``__call__``, without ``self``)."""
    if isinstance(obj, Method):
        method = getattr(obj.cls, obj.name)
        if isinstance(inspect.getattr_static(obj.cls, obj.name), classmethod | staticmethod):
            return inspect.signature(method)  # no self: a classmethod's cls is bound already
        return inspect.Signature(list(inspect.signature(method).parameters.values())[1:])
    if isinstance(obj, Instance):
        return signature(Method(obj.cls, "forward" if hasattr(obj.cls, "forward") else "__call__"))
    return inspect.signature(obj)


def bind_error(call: ast.Call, obj: Any) -> str | None:
    """Why ``call`` (``...`` for left-out arguments) does not bind to ``obj``'s signature; None if it does."""
    positional = []
    for arg in call.args:
        if isinstance(arg, ast.Starred) or (isinstance(arg, ast.Constant) and arg.value is Ellipsis):
            break
        positional.append(None)
    keywords = {k.arg: None for k in call.keywords if k.arg is not None}
    try:
        accepted = signature(obj)
    except TypeError:
        return f"{name_of(obj)} is not callable"
    try:
        accepted.bind_partial(*positional, **keywords)
    except TypeError as exc:
        return f"{name_of(obj)}{accepted}: {exc}"
    return None


def keyword_only_call(code: str) -> ast.Call:
    """A span that is no Python (``expand_experts(model, factor=m | counts=[...])``) as a call with
    only its top-level keyword names, and ``...`` for its positional arguments."""
    name, args = code.split("(", 1)
    depth, top = 0, []
    for char in args[:-1]:
        depth += char in "([{"
        depth -= char in ")]}"
        top.append(char if depth == 0 else " ")
    keywords = re.findall(r"(?<![=\w])(\w+)=(?!=)", "".join(top))
    call = ast.parse(f"{name}(...)", mode="eval").body
    assert isinstance(call, ast.Call)
    call.keywords = [ast.keyword(arg=k, value=ast.Constant(None)) for k in keywords]
    return call


def calls_of(quoted: Quoted) -> tuple[list[ast.Call], dict[str, Any]]:
    """The calls of a quoted piece, and the variables its block binds (imports, ``x = Class(...)``)."""
    code = quoted.code.replace("\\|", "|")
    try:
        tree: ast.AST = ast.parse(code, mode="exec" if quoted.block else "eval")
    except SyntaxError:
        assert not quoted.block, f"{quoted.where}: a python block that does not parse"
        tree = keyword_only_call(code)
    env: dict[str, Any] = {}
    calls = []
    # NOTE: an inline span's arguments are placeholders (``sqrt(p (1 - p) / n)``); a block's calls all count.
    for node in _in_order(tree) if quoted.block else [tree.body if isinstance(tree, ast.Expression) else tree]:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_lit"):
            env.update({a.asname or a.name: getattr(importlib.import_module(node.module), a.name) for a in node.names})
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            callees = candidates(node.value.func, env)
            made = [c for c in callees if isinstance(c, type)]
            env.update({t.id: Instance(made[0]) for t in node.targets if isinstance(t, ast.Name) and made})
            # NOTE: what another library's call returns (``tok = AutoTokenizer.from_pretrained(...)``) is its too.
            env.update({t.id: None for t in node.targets if isinstance(t, ast.Name) and not callees})
        if isinstance(node, ast.Call):
            calls.append(node)
    return calls, env


def _in_order(tree: ast.AST):
    """A block's nodes statement by statement (so a variable is bound before its later uses)."""
    for statement in tree.body:  # type: ignore[attr-defined]
        yield from ast.walk(statement)


@pytest.mark.parametrize("quoted", CALLS, ids=str)
def test_every_quoted_call_binds_to_the_signature_of_what_it_names(quoted):
    calls, env = calls_of(quoted)
    for call in calls:
        where = f"{quoted.where}: {ast.unparse(call)}"
        try:
            found = candidates(call.func, env)
        except (LookupError, AttributeError, ModuleNotFoundError) as exc:
            pytest.fail(f"{where}: {exc}")
        errors = [bind_error(call, obj) for obj in found]
        assert not found or None in errors, f"{where}: " + "; ".join(e for e in errors if e)


def test_every_moe_lit_import_and_name_a_doc_quotes_exists():
    missing = []
    for doc in DOCS:
        for module, names, plain in _IMPORT.findall((REPO / doc).read_text()):
            try:
                imported = importlib.import_module(module or plain)
                missing += [f"{doc}: {module}.{n}" for n in re.findall(r"\w+", names) if not hasattr(imported, n)]
            except ModuleNotFoundError:
                missing.append(f"{doc}: {module or plain}")
    for quoted in QUOTED:
        if _NAME_SPAN.match(quoted.code):
            try:
                dotted(quoted.code)
            except (AttributeError, ModuleNotFoundError):
                missing.append(str(quoted))
    assert not missing, missing


def test_the_checks_catch_a_wrong_keyword_a_missing_name_and_too_many_arguments():
    def problems(code: str) -> list[str]:
        calls, env = calls_of(Quoted("doc.md:1", code, block=False))
        found = candidates(calls[0].func, env)
        errors = [bind_error(calls[0], obj) for obj in found]
        return ["not ours"] if not found else [] if None in errors else errors

    assert problems("dense_to_moe(model, 'granular', 8, 2, granularity=2)") == []
    assert problems("KVCache(static=True)") == []
    assert "unexpected keyword argument 'statik'" in problems("KVCache(statik=True)")[0]
    assert "too many positional arguments" in problems("Transformer.routing_stats(1)")[0]
    assert "multiple values for argument 'factor'" in problems("expand_experts(model, 2, factor=2)")[0]
    assert problems("expand_experts(model, factor=m | counts=[...], selection=uniform|utility)") == []
    assert "'selektion'" in problems("expand_experts(model, factor=m | counts=[...], selektion=uniform|utility)")[0]
    assert problems("torch.load(weights_only=True)") == ["not ours"]
    with pytest.raises(LookupError, match="moe_lit defines no train_runner"):
        problems("train_runner(model_cfg, run)")
