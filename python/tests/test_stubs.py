"""The stubs (`troupe/_troupe.pyi`) say what the built extension (`troupe._troupe`) exports:
every class, function and constant in one is in the other, and so is every public method,
property and attribute of each class. A binding added, renamed or dropped in Rust without its
stub (or the reverse) fails here, not in a user's type checker.

Names only: signatures are not compared (mypy's stubtest would, but PyO3 exposes too little of
them for it to pass cleanly)."""

import ast
import inspect
import pathlib

import pytest

import troupe._troupe as ext

STUB = pathlib.Path(ext.__file__).resolve().parent / "_troupe.pyi"


class Declared:
    """What the stub declares for one class: its bases and its members' names."""

    def __init__(self, node: ast.ClassDef) -> None:
        self.bases = [ast.unparse(b) for b in node.bases]
        self.members: set[str] = set()
        # Annotated attributes with no value: instance attributes (an exception's fields are
        # set when it is raised, so they are on no class object to compare).
        self.instance_attrs: set[str] = set()
        for b in node.body:
            if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.members.add(b.name)
            elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                self.members.add(b.target.id)
                if b.value is None:
                    self.instance_attrs.add(b.target.id)
            elif isinstance(b, ast.Assign):
                self.members.update(t.id for t in b.targets if isinstance(t, ast.Name))


def declarations() -> tuple[dict[str, Declared], set[str], set[str]]:
    """The stub's classes, its other runtime names (functions, constants) and its names that
    exist only for type checkers (aliases such as `WeightArray = Any`, `Protocol` classes)."""
    classes: dict[str, Declared] = {}
    names: set[str] = set()
    typing_only: set[str] = set()
    for node in ast.parse(STUB.read_text(), filename=str(STUB)).body:
        if isinstance(node, ast.ClassDef):
            c = Declared(node)
            if "Protocol" in c.bases:
                typing_only.add(node.name)
            else:
                classes[node.name] = c
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            typing_only.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if ast.unparse(node.annotation).endswith("TypeAlias"):
                typing_only.add(node.target.id)
            else:
                names.add(node.target.id)
    return classes, names, typing_only


def public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_the_module_exports_exactly_what_the_stub_declares():
    classes, names, typing_only = declarations()
    declared = set(classes) | names
    exported = public(dir(ext))
    assert not exported & typing_only, f"declared for type checkers only, but exported: {sorted(exported & typing_only)}"
    assert sorted(exported - declared) == [], "exported by troupe._troupe but missing from _troupe.pyi"
    assert sorted(declared - exported) == [], "declared in _troupe.pyi but not exported by troupe._troupe"
    for name in sorted(declared):
        is_class = inspect.isclass(getattr(ext, name))
        assert is_class == (name in classes), f"{name}: a class in one, not in the other"


@pytest.mark.parametrize("name", sorted(declarations()[0]))
def test_each_class_has_exactly_the_members_the_stub_declares(name):
    declared = declarations()[0][name]
    cls = getattr(ext, name)
    own = public(vars(cls))
    checked = public(declared.members)
    if issubclass(cls, BaseException):
        checked -= declared.instance_attrs
    assert sorted(own - checked) == [], f"{name}: on the class but missing from _troupe.pyi"
    assert sorted(checked - own) == [], f"{name}: in _troupe.pyi but not on the class"
    # Special methods the stub promises (`__iter__`, `__call__`, `__enter__`, ...) must exist.
    missing = sorted(m for m in declared.members if m.startswith("__") and not hasattr(cls, m))
    assert missing == [], f"{name}: declared but not implemented: {missing}"
