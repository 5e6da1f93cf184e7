"""The stubs (`troupe/_troupe.pyi`) say what the built extension (`troupe._troupe`) is: mypy's
`stubtest` compares them, so a binding added, renamed, dropped or given other parameters in
Rust without its stub (or the reverse) fails here, not in a user's type checker.

It checks every class, function and constant, each method's and constructor's parameters
(names, kinds, defaults, as PyO3's `text_signature` exposes them), properties, `__all__` and
which classes can be subclassed (PyO3's cannot: `@final` in the stub). The only names it lets
through are in `stubtest-allowlist.txt`: those that exist for type checkers only."""

import pathlib
import subprocess
import sys

import mypy.stubtest  # noqa: F401  (required: the check must not skip where mypy is missing)

import troupe._troupe as ext

HERE = pathlib.Path(__file__).resolve().parent
ALLOWLIST = HERE / "stubtest-allowlist.txt"


def test_the_stub_matches_the_built_extension():
    # From the package's parent, so `troupe` resolves to the package the extension was built
    # into (the one imported above), stub beside it.
    root = pathlib.Path(ext.__file__).resolve().parent.parent
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "troupe._troupe", "--allowlist", str(ALLOWLIST)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"stubtest: troupe/_troupe.pyi differs from the extension\n{r.stdout}{r.stderr}"
