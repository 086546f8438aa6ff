"""`python -m bench` (make bench): run every benchmark module in turn."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

SKIP = {"common", "__main__", "before_after"}  # before_after needs --rev


def main() -> int:
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                   if m.name not in SKIP and not m.name.startswith("_") and not m.ispkg)
    only = set(sys.argv[1:])
    failed = []
    for name in names:
        if only and name not in only:
            continue
        print(f"\n===== bench.{name} =====", flush=True)
        mod = importlib.import_module(f"bench.{name}")
        if not hasattr(mod, "main"):
            continue
        rc = mod.main()
        if rc:
            failed.append(name)
    print("\nbenchmarks with a failed goal:", ", ".join(failed) if failed else "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
