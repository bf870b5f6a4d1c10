"""Every example of docs/EXTENDING.md runs as written (each block after an ``example:``
marker, after the ``setup`` block), and what it registers is then in the registry the
``LLM`` keyword reads. Registries are restored afterwards. The model-family example has
its own, deeper test (``test_extending_model_family.py``)."""

import os
import re

import pytest

from paged_jax.attention import dispatch
from paged_jax.cache import eviction, policies
from paged_jax.engine import admission, victim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "EXTENDING.md")


def examples() -> dict[str, str]:
    with open(DOC) as f:
        text = f.read()
    found = re.findall(r"<!-- example: ([\w ]+) -->\n```python\n(.*?)```", text, re.S)
    return dict(found)


# example -> (registry, the name it registers)
REGISTERS = {
    "allocation policy": (policies.POLICIES, "top_down"),
    "eviction policy": (eviction.EVICTION_POLICIES, "newest_first"),
    "victim policy": (victim.VICTIM_POLICIES, "longest_first"),
    "admission policy": (admission.ADMISSION_POLICIES, "longest_prompt_first"),
    "attention implementation": (dispatch.IMPLS, "scaled_reference"),
}


def test_every_documented_kind_has_an_example():
    assert set(REGISTERS) | {"setup", "model family"} == set(examples())


@pytest.mark.parametrize("name", sorted(REGISTERS))
def test_example_runs_and_registers(name):
    code = examples()
    registry, key = REGISTERS[name]
    before = dict(registry)
    assert key not in before
    scope = {"__name__": "extending_example"}
    try:
        exec(compile(code["setup"], "EXTENDING.md:setup", "exec"), scope)
        exec(compile(code[name], f"EXTENDING.md:{name}", "exec"), scope)  # its own asserts check the effect
        assert key in registry
    finally:
        registry.clear()
        registry.update(before)
