"""What a compiled program communicates: its collectives, read from the optimised HLO text.

``collectives(text)`` lists every collective instruction (all-reduce, all-gather,
reduce-scatter, all-to-all, collective-permute; async ``-start`` forms included) with its
result shape, bytes, and how many times it runs per call: ops inside a ``while`` body run
once per trip (XLA records a loop's ``known_trip_count``; the layer scan's is the depth),
so ``bytes_per_call`` is the traffic of one call (a decode step), per device.
``copies(text, shape)`` lists the instructions that copy or convert a whole array of a
given shape (a KV pool that should stay in place).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.+?) (" + "|".join(KINDS) + r")(?:-start)?\(")
_ANY_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")
_WRAPPED_COPY = re.compile(r"calls=%wrapped_(?:bitcast-)?(?:convert|copy)")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_WHILE = re.compile(r" while\(.*?body=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"(?:to_apply|calls|branch_computations|true_computation|false_computation)=\{?%([\w.\-]+)")


class Collective(NamedTuple):
    kind: str  # one of KINDS
    shape: str  # the result type as written, e.g. "f32[8,1,64]"
    bytes: int  # result bytes per execution (the data each device ends up with)
    runs: int  # executions per call of the program (loop trips multiplied)
    computation: str


def _bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    out, name = {}, None
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            name = match.group(1)
            out[name] = []
        elif name is not None and line.strip() != "}":
            out[name].append(line)
    return out


def _runs(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """Executions per call of every computation reachable from ``entry`` (a while body
    runs its loop's known trip count per execution of the loop; 1 when unknown)."""
    runs = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps.get(name, []):
            body = _WHILE.search(line)
            if body:
                trips = _TRIPS.search(line)
                child = body.group(1)
                runs[child] = runs[name] * (int(trips.group(1)) if trips else 1)
                stack.append(child)
            for child in _CALLS.findall(line):
                if child not in runs:
                    runs[child] = runs[name]
                    stack.append(child)
    return runs


def collectives(text: str) -> list[Collective]:
    """Every collective in an optimised HLO module (``jitted.lower(...).compile().as_text()``)."""
    comps = _computations(text)
    entry = next((m.group(1) for line in text.splitlines() if line.startswith("ENTRY")
                  for m in [_COMPUTATION.match(line)] if m), None)
    runs = _runs(comps, entry) if entry else {}
    out = []
    for name, lines in comps.items():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if match:
                shape, kind = match.group(1), match.group(2)
                out.append(Collective(kind, shape, _bytes(shape), runs.get(name, 1), name))
    return out


def summary(text: str) -> dict:
    """``{kind: {"ops": instructions, "runs": executions per call, "bytes": bytes per call}}``
    for every kind in ``KINDS``, and ``"bytes_per_call"`` over all of them."""
    found = collectives(text)
    out = {kind: {"ops": 0, "runs": 0, "bytes": 0} for kind in KINDS}
    for c in found:
        out[c.kind]["ops"] += 1
        out[c.kind]["runs"] += c.runs
        out[c.kind]["bytes"] += c.bytes * c.runs
    out["bytes_per_call"] = sum(c.bytes * c.runs for c in found)
    return out


def copies(text: str, shape: str) -> list[str]:
    """Instructions of ``text`` whose result type matches the regex ``shape`` (e.g.
    ``r"\\[2,2,48,16\\]"``) and that copy or convert it: a ``copy`` or ``convert``, or a
    fusion named after one or calling a wrapped one. Operands do not count: a
    ``conditional`` on ``%reduce_convert_fusion`` returning the pool copies nothing.
    Returns the lines, stripped and cut to 160 characters."""
    wanted = re.compile(shape)
    found = []
    for line in text.splitlines():
        match = _ANY_INSTRUCTION.match(line)
        if not match:
            continue
        name, result, opcode, rest = match.groups()
        copying = opcode in ("copy", "convert") or opcode == "fusion" and (
            name.startswith(("copy", "convert")) or _WRAPPED_COPY.search(rest))
        if copying and wanted.search(result):
            found.append(line.strip()[:160])
    return found
