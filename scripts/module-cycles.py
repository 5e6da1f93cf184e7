#!/usr/bin/env python3
"""Fail on dependency cycles between the modules of a crate (issue 35).

What it checks, for every library and binary root of the workspace (crates/*/src/lib.rs,
crates/*/src/main.rs, src/lib.rs, src/main.rs) and of the Python extension (python/src/lib.rs):

* The module tree, built the way rustc builds it: `mod name;` in a file is followed to
  `name.rs` or `name/mod.rs` (or its `#[path]`), `mod name { ... }` is an inline module.
* Every path into the crate that a module's code spells: `crate::a::b`, `$crate::a::b`,
  `super::a`, `self::a`, `use` groups (`use crate::{a, b::{c, d}}`), and, in a `use`, a path
  that starts at a child module (`use child::Item`). Each path is resolved to the module that
  defines it, following the `use` items of the modules it passes through (`pub use` re-exports
  in lib.rs or a mod.rs, and private imports a child reaches through `super::Name`; a glob
  `use x::*` is not followed, so a name reached only through a glob counts as its parent's).
* An edge A -> B between two sibling modules when code anywhere under A names something under
  B. Siblings are compared at the crate root (the top-level modules) and, one level deeper,
  among the children of each top-level module (e.g. `serve/fork.rs` and `serve/replace.rs`);
  `--depth N` looks N levels down instead of 2. A parent's own file (lib.rs, mod.rs) is not
  a node: its items and its references to its children are the parent's, not a sibling's.
* Every strongly connected component of more than one module is a cycle: it is printed with
  one source line for each edge inside it, and the script exits 1 -- unless the cycle is one
  of KNOWN below, the few not broken yet when this check was added, which are printed as known
  (`--strict` fails on them too). A KNOWN entry that is no longer found also fails the check,
  so the list only shrinks: delete the entry in the change that breaks its cycle.

Not counted: comments (intra-doc links included) and string literals; items under exactly
`#[cfg(test)]` (a `mod tests { ... }` block, a `#[cfg(test)] mod tests;` file, a test-only
`use` or fn); the crates' own tests/ directories, benches and examples; paths into other crates.
Macros are read as text, so a `crate::` path inside a `macro_rules!` counts where it is written.

    python3 scripts/module-cycles.py [--depth N] [--strict] [ROOT ...]

Exit status: 0 when no cycle (known ones aside), 1 otherwise. Python 3 standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Cycles not broken yet (issue 35), as the check prints them, with why each is still there.
# Empty: the last three (serving's gateway forward <-> stream and control_plane, the Python
# extension's arrays <-> dlpack) were broken by moving the shared pieces below both sides.
KNOWN: dict[str, str] = {}

TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<line_comment>//[^\n]*)
  | (?P<block_comment>/\*)
  | (?P<raw_str>b?r(?P<hashes>\#*)")
  | (?P<str>b?")
  | (?P<char>b?'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])')
  | (?P<lifetime>'[A-Za-z_][A-Za-z0-9_]*)
  | (?P<ident>(?:r\#)?[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>[0-9][0-9A-Za-z_.]*)
  | (?P<path_sep>::)
  | (?P<punct>.)
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass
class Tok:
    text: str
    line: int


def tokenize(src: str) -> list[Tok]:
    """Identifiers, `::` and single punctuation, with comments and literals dropped."""
    toks: list[Tok] = []
    pos, line = 0, 1
    while pos < len(src):
        m = TOKEN.match(src, pos)
        assert m is not None
        kind, text = m.lastgroup, m.group(0)
        end = m.end()
        if kind == "hashes":
            kind = "raw_str"
        if kind == "block_comment":
            depth, end = 1, m.end()
            while depth and end < len(src):
                if src.startswith("/*", end):
                    depth, end = depth + 1, end + 2
                elif src.startswith("*/", end):
                    depth, end = depth - 1, end + 2
                else:
                    end += 1
        elif kind == "raw_str":
            close = '"' + (m.group("hashes") or "")
            end = src.find(close, m.end())
            end = len(src) if end < 0 else end + len(close)
        elif kind == "str":
            end = m.end()
            while end < len(src) and src[end] != '"':
                end += 2 if src[end] == "\\" else 1
            end += 1
        elif kind in ("ident", "path_sep", "punct"):
            toks.append(Tok(text.removeprefix("r#"), line))
        line += src.count("\n", pos, end)
        pos = end
    return toks


def skip_balanced(toks: list[Tok], i: int) -> int:
    """Index after the bracketed group that opens at `toks[i]`."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[toks[i].text]]
    i += 1
    while stack and i < len(toks):
        t = toks[i].text
        if t in pairs:
            stack.append(pairs[t])
        elif t == stack[-1]:
            stack.pop()
        i += 1
    return i


def skip_item(toks: list[Tok], i: int) -> int:
    """Index after the item starting at `toks[i]` (its attributes included): up to its `;` or
    the end of its first `{ ... }` block."""
    while i < len(toks):
        t = toks[i].text
        if t == ";":
            return i + 1
        if t == "{":
            return skip_balanced(toks, i)
        if t in "([":
            i = skip_balanced(toks, i)
        else:
            i += 1
    return i


def is_cfg_test(toks: list[Tok], i: int) -> bool:
    """Whether `#[cfg(test)]` starts at `toks[i]`."""
    return [t.text for t in toks[i : i + 7]] == ["#", "[", "cfg", "(", "test", ")", "]"]


def parse_path(toks: list[Tok], i: int) -> tuple[list[list[str]], int]:
    """The paths spelled from `toks[i]` (a `use` tree: groups expand into one path each; `as`
    renames and generic arguments end a path), and the index after them."""
    prefix: list[str] = []
    while i < len(toks):
        t = toks[i].text
        if t == "{":
            paths: list[list[str]] = []
            i += 1
            while i < len(toks) and toks[i].text != "}":
                if toks[i].text == ",":
                    i += 1
                    continue
                inner, i = parse_path(toks, i)
                paths += [prefix + (p[1:] if p[:1] == ["self"] else p) for p in inner]
                if i < len(toks) and toks[i].text not in ",}":
                    i = skip_to_group_end(toks, i)
            return paths or [prefix], i + 1
        if t == "*":
            return [prefix], i + 1
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t):
            break
        prefix.append(t)
        i += 1
        if i < len(toks) and toks[i].text == "as" and i + 1 < len(toks):
            i += 2
            break
        if i < len(toks) and toks[i].text == "::":
            i += 1
        else:
            break
    return [prefix], i


def skip_to_group_end(toks: list[Tok], i: int) -> int:
    """Index of the next `,` or `}` at this group level."""
    while i < len(toks) and toks[i].text not in ",}":
        i = skip_balanced(toks, i) if toks[i].text in "([{" else i + 1
    return i


@dataclass
class Ref:
    """A path one module's code spells, with where it is written."""

    module: tuple[str, ...]
    path: list[str]
    file: Path
    line: int
    in_use: bool


@dataclass
class Module:
    """A module of the tree: its children and the names its `use` items bring in."""

    path: tuple[str, ...]
    children: set[str] = field(default_factory=set)
    imports: dict[str, list[str]] = field(default_factory=dict)


class Crate:
    """One crate root's module tree and the paths its code spells."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[tuple[str, ...], Module] = {}
        self.refs: list[Ref] = []
        self.read_file(root, (), root.parent)

    def read_file(self, file: Path, path: tuple[str, ...], child_dir: Path) -> None:
        """Read a file module: `child_dir` is where its `mod name;` children live."""
        toks = tokenize(file.read_text(encoding="utf-8"))
        self.modules.setdefault(path, Module(path))
        self.read_items(toks, 0, len(toks), path, file, child_dir, True)

    def read_items(
        self,
        toks: list[Tok],
        i: int,
        end: int,
        path: tuple[str, ...],
        file: Path,
        child_dir: Path,
        item_level: bool,
    ) -> None:
        """Scan `toks[i:end]`, the body of module `path` (`item_level`: its items, not a block
        inside one)."""
        module = self.modules[path]
        attr_path: str | None = None
        while i < end:
            t = toks[i].text
            if t == "#" and is_cfg_test(toks, i):
                i = skip_item(toks, i)
                continue
            if t == "#" and i + 1 < end and toks[i + 1].text == "[":
                close = skip_balanced(toks, i + 1)
                words = [x.text for x in toks[i + 2 : close - 1]]
                if words[:2] == ["path", "="]:
                    attr_path = self.path_attr(file, toks[i + 2].line)
                i = close
                continue
            if t == "mod" and i + 2 < end and toks[i + 2].text in ";{":
                name = toks[i + 1].text
                module.children.add(name)
                child = path + (name,)
                self.modules.setdefault(child, Module(child))
                if toks[i + 2].text == ";":
                    self.read_child(name, child, attr_path, file, child_dir)
                    i += 3
                else:
                    close = skip_balanced(toks, i + 2)
                    self.read_items(toks, i + 3, close - 1, child, file, child_dir / name, True)
                    i = close
                attr_path = None
                continue
            if t == "use":
                line = toks[i].line
                paths, i = parse_path(toks, i + 1)
                self.refs += [Ref(path, p, file, line, True) for p in paths]
                if item_level:
                    for p in paths:
                        if p and p[-1] not in ("*", "self", "super", "crate"):
                            module.imports[p[-1]] = p
                continue
            if t in ("crate", "super", "self") and i + 1 < end and toks[i + 1].text == "::":
                line = toks[i].line
                paths, i = parse_path(toks, i)
                self.refs += [Ref(path, p, file, line, False) for p in paths]
                continue
            if t == "{":
                # A block (a fn body, an impl): its `use` items are local, not the module's.
                close = skip_balanced(toks, i)
                self.read_items(toks, i + 1, close - 1, path, file, child_dir, False)
                i = close
                continue
            i += 1

    def read_child(
        self, name: str, child: tuple[str, ...], attr_path: str | None, file: Path, child_dir: Path
    ) -> None:
        """Follow `mod name;` to its file."""
        if attr_path is not None:
            target = file.parent / attr_path
            self.read_file(target, child, target.parent / target.stem)
            return
        for target, sub_dir in (
            (child_dir / f"{name}.rs", child_dir / name),
            (child_dir / name / "mod.rs", child_dir / name),
        ):
            if target.exists():
                self.read_file(target, child, sub_dir)
                return
        print(f"warning: {file}: module {name} has no file", file=sys.stderr)

    @staticmethod
    def path_attr(file: Path, line: int) -> str | None:
        """The string of a `#[path = "..."]` attribute on `line` of `file`."""
        text = file.read_text(encoding="utf-8").splitlines()[line - 1]
        m = re.search(r'path\s*=\s*"([^"]+)"', text)
        return m.group(1) if m else None

    def absolute(self, module: tuple[str, ...], path: list[str], in_use: bool) -> list[str] | None:
        """The crate-absolute form of `path` written in `module`, or None when it leaves the
        crate (another crate, std, a name the script cannot place)."""
        if not path:
            return None
        base = list(module)
        rest = list(path)
        if rest[0] in ("crate", "$crate"):
            return rest[1:]
        if rest[0] == "self":
            return base + rest[1:]
        if rest[0] == "super":
            while rest and rest[0] == "super":
                if not base:
                    return None
                base.pop()
                rest.pop(0)
            return base + rest
        if in_use and rest[0] in self.modules[module].children:
            return base + rest
        return None

    def resolve(self, path: list[str]) -> tuple[str, ...]:
        """The module that defines what the absolute `path` names, following `use` items."""
        current: tuple[str, ...] = ()
        rest = list(path)
        for _ in range(64):
            if not rest:
                return current
            head = rest[0]
            module = self.modules.get(current)
            if module is None:
                return current
            if head in module.children:
                current, rest = current + (head,), rest[1:]
                continue
            target = module.imports.get(head)
            if target is None:
                return current
            absolute = self.absolute(current, target, True)
            if absolute is None:
                return current
            current, rest = (), absolute + rest[1:]
        return current


def sibling_edges(crate: Crate, depth: int) -> dict[tuple[str, ...], dict[tuple[str, str], list[Ref]]]:
    """Per parent module (the crate root, then its children down to `depth`), the edges
    between its children, each with the references that make it."""
    graphs: dict[tuple[str, ...], dict[tuple[str, str], list[Ref]]] = {}
    for ref in crate.refs:
        absolute = crate.absolute(ref.module, ref.path, ref.in_use)
        if absolute is None:
            continue
        target = crate.resolve(absolute)
        source = ref.module
        common = 0
        while common < min(len(source), len(target)) and source[common] == target[common]:
            common += 1
        if common >= depth or common >= len(source) or common >= len(target):
            continue
        parent = source[:common]
        edge = (source[common], target[common])
        graphs.setdefault(parent, {}).setdefault(edge, []).append(ref)
    return graphs


def cycles(edges: dict[tuple[str, str], list[Ref]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)
        succ.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return found


def roots(args: list[str]) -> list[Path]:
    """The crate roots to check: the arguments, or every root of the workspace."""
    if args:
        return [Path(a) for a in args]
    found = []
    for src in sorted(REPO.glob("crates/*/src")) + [REPO / "src", REPO / "python" / "src"]:
        found += [src / f for f in ("lib.rs", "main.rs") if (src / f).exists()]
    return found


def shown(path: Path) -> Path:
    """`path` relative to the repository, where it is in it."""
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=2, help="levels of siblings (default 2)")
    parser.add_argument("--strict", action="store_true", help="fail on KNOWN cycles too")
    parser.add_argument("roots", nargs="*", help="crate roots (default: the workspace's)")
    opts = parser.parse_args()
    new, found = 0, set()
    for root in roots(opts.roots):
        crate = Crate(root.resolve())
        for parent, edges in sorted(sibling_edges(crate, opts.depth).items()):
            for component in cycles(edges):
                where = "::".join(parent) or "crate root"
                name = f"{shown(crate.root)} ({where}): {' <-> '.join(component)}"
                known = name in KNOWN and not opts.strict
                found.add(name)
                new += not known
                print(f"{'known cycle' if known else 'cycle'} in {name}")
                if known:
                    print(f"  not broken yet: {KNOWN[name]}")
                for (a, b), refs in sorted(edges.items()):
                    if a in component and b in component:
                        first = refs[0]
                        more = f" (+{len(refs) - 1} more)" if len(refs) > 1 else ""
                        path = "::".join(first.path)
                        print(f"  {a} -> {b}: {shown(first.file)}:{first.line} {path}{more}")
    gone = [] if opts.roots else sorted(set(KNOWN) - found)
    for name in gone:
        print(f"error: known cycle no longer found, delete it from KNOWN: {name}")
    if new:
        print(f"error: {new} module cycle(s); move the shared piece into a module both sides use")
    if new or gone:
        return 1
    known = f" ({len(found)} known, above)" if found else ""
    print(f"module-cycles: no new cycles between sibling modules{known}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
