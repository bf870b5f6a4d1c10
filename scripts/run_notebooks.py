"""Execute the notebooks in place, so the committed copies show their tables and plots.

    python scripts/run_notebooks.py [notebooks/NAME.ipynb ...]   (default: every notebook)

What ``make notebooks`` runs. Each notebook runs top to bottom in a fresh kernel (the
venv's python3), then its outputs are saved with what changes from run to run removed
(cell timing metadata), so a rerun's diff shows only outputs that really changed. The suite
(``pytest --nbmake``) still executes every notebook from scratch: the saved outputs are
for readers browsing the repository.
"""

from __future__ import annotations

import glob
import os
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(path: str, timeout: int = 900) -> float:
    """Execute ``path`` in place; returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    env_before = os.environ.get("JAX_PLATFORMS")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("JAX_PLATFORMS", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    paths = argv or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    for path in paths:
        seconds = run(path)
        size = os.path.getsize(path) / 1024
        print(f"{os.path.relpath(path, ROOT)}: {seconds:.0f} s, {size:.0f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:])
