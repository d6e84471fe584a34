"""flagella CLI entry point."""

from __future__ import annotations

import sys


def main() -> int:
    print("flagella: no commands yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
