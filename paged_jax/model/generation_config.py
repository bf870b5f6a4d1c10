"""What a checkpoint says about generating with it: its EOS ids and sampling defaults.

Hugging Face checkpoints spread this over two files. ``config.json`` names an
``eos_token_id`` (an int or a list); ``generation_config.json``, when present, names
another (instruct checkpoints list several: Llama-3's ``<|end_of_text|>`` and
``<|eot_id|>``) and the sampling defaults the authors recommend. Generation stops at
any of the ids; the defaults apply when a caller gives no ``SamplingParams``, as vLLM's
``generation_config="auto"`` does.
"""

from __future__ import annotations

import dataclasses
import numbers
import os

# generation_config.json key -> SamplingParams field: the keys vLLM takes as defaults.
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's generation facts.

    Attributes:
      eos_token_ids: every end-of-sequence id, config.json's first, in file order.
      sampling: ``SamplingParams`` field -> value from generation_config.json (only the
        keys in ``SAMPLING_KEYS`` that the file sets).
      bos_token_id: from generation_config.json, else config.json; None if neither.
    """

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = dataclasses.field(default_factory=dict)
    bos_token_id: int | None = None


def token_ids(value, where: str) -> tuple[int, ...]:
    """An ``eos_token_id`` entry (None, an int or a list of ints) as a tuple."""
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}: eos_token_id={value!r}: expected a non-negative int or a list of them")
    return tuple(int(v) for v in values)


def generation_defaults(config: dict, generation_config: dict | None, *, where: str = "") -> GenerationDefaults:
    """The ``GenerationDefaults`` of a checkpoint's parsed config.json (``config``) and
    generation_config.json (``generation_config``, None when absent); ``where`` names the
    checkpoint in errors."""
    config_file = os.path.join(where, "config.json")
    gen_file = os.path.join(where, "generation_config.json")
    eos = list(token_ids(config.get("eos_token_id"), config_file))
    bos = config.get("bos_token_id")
    sampling = {}
    if generation_config is not None:
        gen = generation_config
        eos += [t for t in token_ids(gen.get("eos_token_id"), gen_file) if t not in eos]
        bos = gen.get("bos_token_id", bos)
        sampling = {field: gen[key] for key, field in SAMPLING_KEYS.items() if gen.get(key) is not None}
    if not isinstance(bos, numbers.Integral) or isinstance(bos, bool):
        bos = None
    return GenerationDefaults(eos_token_ids=tuple(eos), sampling=sampling, bos_token_id=bos)
