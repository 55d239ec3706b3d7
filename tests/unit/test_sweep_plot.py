"""The sweep's plot: a real PNG drawn by matplotlib, and without matplotlib (the ``plots``
extra) a sweep that runs on and says once how to get it, never a traceback."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path

from silentswarm.cli.experiments import plot

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Put first on sys.meta_path in a fresh interpreter: every import of matplotlib fails, as it
# does where the extra is not installed.
BLOCK_MATPLOTLIB = """
import sys

class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMatplotlib())
"""


def png_chunks(data: bytes) -> dict[bytes, list[bytes]]:
    assert data[:8] == PNG_SIGNATURE
    chunks: dict[bytes, list[bytes]] = {}
    i = 8
    while i < len(data):
        (length,) = struct.unpack(">I", data[i : i + 4])
        chunks.setdefault(data[i + 4 : i + 8], []).append(data[i + 8 : i + 8 + length])
        i += 12 + length
    return chunks


def test_plot_points_are_the_rows_with_both_numbers():
    rows = [
        {"bytes_per_step_per_boundary": "100", "final_val_loss": "2", "compression": "fp16"},
        {"bytes_per_step_per_boundary": "", "final_val_loss": "2", "compression": "none"},
        {"final_val_loss": "2"},
    ]
    assert plot.plot_points(rows) == [(100.0, 2.0, "fp16")]


def test_the_scatter_plot_is_a_png_drawn_by_matplotlib():
    points = [(1e3, 2.0, "none"), (2.5e2, 2.2, "fixed_int8"), (0.0, 2.5, "none")]
    png = plot.scatter_png(points, width_px=640, height_px=400)
    chunks = png_chunks(png)
    assert struct.unpack(">II", chunks[b"IHDR"][0][:8]) == (640, 400)
    assert len(png) > 10_000  # axes, labels, legend: not an empty canvas
    software = b"".join(chunks.get(b"tEXt", []))
    assert b"Matplotlib" in software, "the PNG was not written by matplotlib"
    assert "matplotlib" in sys.modules
    # The points are drawn, one colour per group (matplotlib's first two: C0 and C1).
    assert _pixels_of(png, "C0") > 50 and _pixels_of(png, "C1") > 50


def _pixels_of(png: bytes, colour: str) -> int:
    """How many pixels of the decoded PNG are ``colour`` (a matplotlib colour name)."""
    from matplotlib import image
    from matplotlib.colors import to_rgb

    rgb = image.imread(io.BytesIO(png), format="png")[:, :, :3]
    return int((abs(rgb - to_rgb(colour)).max(axis=2) < 0.02).sum())


def test_no_usable_point_is_still_a_valid_plot():
    png = plot.scatter_png([(0.0, 1.0, "none")])
    assert png_chunks(png)[b"IHDR"]
    assert png[:8] == PNG_SIGNATURE
    assert _pixels_of(png, "C0") == 0  # no point drawn


def _swarm_without_matplotlib(*argv: str) -> subprocess.CompletedProcess[str]:
    code = BLOCK_MATPLOTLIB + (
        f"sys.argv = ['swarm', *{list(argv)!r}]\nfrom swarm.cli.app import main\nmain()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_without_matplotlib_a_sweep_runs_on_and_says_once_how_to_get_its_plot(tmp_path):
    config = tmp_path / "s.json"
    config.write_text(json.dumps({"name": "s", "base": {"steps": 5}, "grid": {}}))
    unreachable = "http://127.0.0.1:1"
    argv = ("--leader-url", unreachable, "sweep", "--config", str(config), "--out", str(tmp_path))
    done = _swarm_without_matplotlib(*argv)
    # It goes on (to the unreachable leader: exit 3), having said once how to get the plot.
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert "cannot reach the leader" in done.stderr
    said = (done.stdout + done.stderr).count("pip install 'silentswarm[plots]'")
    assert said == 1, done.stdout + done.stderr
    assert f"no {plot.PLOT_FILE}: plotting needs matplotlib" in done.stdout
    # --no-plot asks for no plot: nothing to say about matplotlib.
    done = _swarm_without_matplotlib(*argv, "--no-plot")
    assert done.returncode == 3, done.stderr
    assert "matplotlib" not in done.stdout + done.stderr


def test_without_matplotlib_drawing_raises_the_error_naming_the_extra():
    code = BLOCK_MATPLOTLIB + (
        "from silentswarm.cli.experiments import plot\n"
        "from silentswarm.errors import ExtraMissingError\n"
        "try:\n"
        "    plot.scatter_png([(1.0, 1.0, 'none')])\n"
        "except ExtraMissingError as exc:\n"
        "    print(exc.code, exc.message)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("EXTRA_MISSING plotting needs matplotlib")
    assert "silentswarm[plots]" in done.stdout
