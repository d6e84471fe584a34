"""flagella-cni entry point (CNI spec 1.1.0). The commands that talk to the
endpoint service come with issue #6; VERSION answers now."""

from __future__ import annotations

import json
import os
import sys

SUPPORTED_VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]


def main() -> int:
    command = os.environ.get("CNI_COMMAND", "")
    if command == "VERSION":
        json.dump({"cniVersion": "1.1.0", "supportedVersions": SUPPORTED_VERSIONS}, sys.stdout)
        return 0
    json.dump(
        {"cniVersion": "1.1.0", "code": 4, "msg": f"CNI_COMMAND {command!r} is not supported yet"},
        sys.stdout,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
