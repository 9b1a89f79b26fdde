"""The `treadle` console script: the CLI when its extra is installed, one readable line when it is not.

The base install is the SDK only, yet pip installs the script with it; without this the script would end in an
ImportError traceback for `typer`.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from treadle.cli import main as cli_main
    except ModuleNotFoundError as exc:
        print(
            f"error: the treadle command needs the cli extra ({exc.name} is not installed): "
            "pip install 'treadle[all]' (or 'treadle[cli,worker,sink]')",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    cli_main()
