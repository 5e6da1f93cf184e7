"""The `troupe` command of the wheel: the Rust CLI, run by the extension in this process."""

import sys

from ._troupe import cli_main


def main() -> None:
    """Runs `troupe` with this process's arguments and exits with its status."""
    sys.exit(cli_main(sys.argv))
