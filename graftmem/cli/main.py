"""The entry point: parse, run one command, turn errors into one line and an exit code."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from .parser import build_parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .. import GraftmemError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except GraftmemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, UnicodeError) as exc:  # bad input the API did not name: still one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
