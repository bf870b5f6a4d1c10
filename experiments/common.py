"""What every study shares: machine description and JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform


def machine_info() -> dict:
    import jax

    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        **cpu_model(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "libraries": library_versions(),
    }


# The instruction sets that decide which dtype is fast on an x86 CPU (XLA:CPU and oneDNN
# dispatch on them): figures from two CPUs with and without them are not comparable.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def cpu_model() -> dict:
    """``{"cpu_model": name, "cpu_flags": [those of CPU_FLAGS present]}`` from /proc/cpuinfo
    (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags_line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(flags_line.split(":", 1)[-1].split())
    return {"cpu_model": name, "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


def library_versions() -> dict:
    """Installed versions of the libraries a figure depends on (None if absent)."""
    from importlib import metadata

    versions = {}
    for name in ("jax", "jaxlib", "flax", "numpy", "chex", "tokenizers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_json(out_dir: str, name: str, result: dict) -> str:
    """Write ``result`` to OUT_DIR/NAME.json (must hold a "headline" object)."""
    if "headline" not in result:
        raise ValueError(f"{name}: a study's JSON needs a 'headline' object")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=float)
    print(f"wrote {path}")
    return path


def print_headline(headline: dict, digits: int = 3) -> None:
    """One line of a study's headline, floats rounded to ``digits`` decimals; a float smaller than that
    keeps ``digits`` significant digits instead (a 4.4e-05 score error is not shown as 0.0)."""

    def shown(v: float) -> float:
        return round(v, digits) if v == 0 or abs(v) >= 10**-digits else float(f"{v:.{digits}g}")

    print("headline:", {k: shown(v) if isinstance(v, float) else v for k, v in headline.items()})


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (studies run without a screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def shown_path(path: str) -> str:
    """A path as a study's JSON names it: relative to the repository when inside it, else
    with ``~`` for the home directory."""
    path = os.path.abspath(os.path.expanduser(path))
    rel = os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return path.replace(os.path.expanduser("~"), "~") if rel.startswith("..") else rel
