"""One name, one job: no public function or class of ``moe_lit`` is defined in two modules, unless
every module defining it implements the interface that names it (a command's ``configure`` /
``run``, a passthrough command's ``main``, a study kind's ``StudyKind`` members). A re-export is an
import, not a definition, so it never counts."""

import ast
from collections import defaultdict
from pathlib import Path

import moe_lit
from moe_lit.console_script import COMMANDS, PASSTHROUGH_COMMANDS
from moe_lit.studies.kinds import StudyKind
from moe_lit.studies.plugins import KINDS

PACKAGE = Path(moe_lit.__file__).parent


def _interfaces() -> dict[str, set[str]]:
    """Name -> the modules whose interface declares it."""
    commands = {module for module, _help in COMMANDS.values()}
    passthrough = {COMMANDS[name][0] for name in PASSTHROUGH_COMMANDS}
    kind_members = {name for name in vars(StudyKind) if not name.startswith("_")}
    interfaces = {"configure": commands, "run": commands, "main": passthrough | {"moe_lit.console_script"}}
    return interfaces | {name: {kind.__name__ for kind in KINDS.values()} for name in kind_members}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def definitions(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Public name -> the modules that define a function or class of that name at their top level."""
    defined: dict[str, set[str]] = defaultdict(set)
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            is_definition = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if is_definition and not node.name.startswith("_"):
                defined[node.name].add(_module_name(path, root))
    return defined


def duplicates(defined: dict[str, set[str]], interfaces: dict[str, set[str]]) -> dict[str, set[str]]:
    """The names defined in two or more modules that are not all implementers of one interface."""
    return {
        name: modules
        for name, modules in defined.items()
        if len(modules) > 1 and not modules <= interfaces.get(name, set())
    }


def test_no_public_name_is_defined_for_two_jobs():
    assert duplicates(definitions(), _interfaces()) == {}


def test_the_check_sees_definitions_not_imports_and_allows_interfaces(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import shared\n")
    (package / "a.py").write_text("def shared(): ...\ndef run(): ...\nclass Plan: ...\n_private = 1\n")
    (package / "b.py").write_text("from pkg.a import shared\ndef run(): ...\ndef Plan(): ...\ndef _helper(): ...\n")
    defined = definitions(package)
    assert defined["shared"] == {"pkg.a"} and "_helper" not in defined
    assert duplicates(defined, {"run": {"pkg.a", "pkg.b"}}) == {"Plan": {"pkg.a", "pkg.b"}}
    assert duplicates(defined, {}) == {"Plan": {"pkg.a", "pkg.b"}, "run": {"pkg.a", "pkg.b"}}
