"""The Ops UI's picture in the README (docs/ops-ui.png), taken from a real run.

Runs the Ops UI browser test (a real nats-server, leader and two fellows training a tiny
two-stage job that validates every 4 steps, Debian's chromium through chromedriver) with
``OPS_UI_SCREENSHOT`` set: once the job's loss curve has a dozen validation points, the test
saves the page, the job's detail open, there. Then checks it stays under 300 KB.

    .venv/bin/python exp/screenshot_ops_ui.py [--out docs/ops-ui.png]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/ui/test_ops_ui.py::test_ops_ui_shows_fellows_logs_loss_and_the_cluster"
MAX_BYTES = 300_000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "ops-ui.png")
    args = parser.parse_args()
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OPS_UI_SCREENSHOT": str(out)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", TEST], cwd=ROOT, env=env)
    if run.returncode != 0:
        print(f"the Ops UI test failed (exit {run.returncode}): no screenshot", file=sys.stderr)
        return 1
    size = out.stat().st_size
    if size > MAX_BYTES:
        print(f"{out}: {size} bytes, over {MAX_BYTES}", file=sys.stderr)
        return 1
    print(f"{out}: {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
