"""The public offline API, with vLLM's names: ``LLM``, ``SamplingParams``, ``RequestOutput``.

    llm = LLM("tests/fixtures/llama_text", max_num_seqs=8)
    outs = llm.generate(["The river", {"prompt_token_ids": [4, 5]}],
                        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, stop=["\\n\\n"]))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, llm.stats()

``LLM`` is a thin front door: its keywords become one ``EngineConfig``
(``config.EngineArgs``, which documents every one of them), it owns one ``LLMEngine`` per
data-parallel replica and a ``Router`` that assigns each request to one, and it turns
prompts into requests (``intake.py``) and requests into outputs (``outputs.py``).

Differences from vLLM worth knowing: prompts longer than ``max_model_len - 1`` are
rejected up front, before anything is generated (vLLM raises too); generation stops at
``max_model_len`` total tokens with finish reason "length"; without ``num_gpu_blocks`` or
``kv_cache_memory_bytes`` the pool is sized from device memory (``memory.py``) without a
profiling pass; ``kv_cache="static"`` runs the pre-PagedAttention baseline
(``accounting.py``); an exception inside ``generate`` (Ctrl-C included) aborts every
unfinished request and empties the pool, so the next call starts clean.
"""

from __future__ import annotations

import dataclasses
import warnings

from paged_jax.compilation_cache import enable_compilation_cache, mappings_pressure
from paged_jax.engine import intake
from paged_jax.engine.beam import BeamSearchOutput, BeamSearchParams
from paged_jax.engine.config import EngineArgs, EngineConfig
from paged_jax.engine.engine import LLMEngine
from paged_jax.engine.outputs import RequestOutput, delta_output, is_done
from paged_jax.engine.progress import Progress
from paged_jax.engine.prompts import normalise_prompts
from paged_jax.engine.router import Router, run_engines
from paged_jax.engine.sampling import RequestOutputKind, SamplingParams
from paged_jax.engine.sequence import SequenceGroup
from paged_jax.engine.stats import merged_summary


class LLMInfo:
    """What an ``LLM`` is, without its engines: every answer here is read from its
    ``EngineConfig`` (tokenizer, limits, defaults, chat rendering), so a process that only
    talks to an engine elsewhere (the server's HTTP side with the engine in its own
    process, ``paged_jax.serve.engine_process``) answers exactly as the ``LLM`` would."""

    def __init__(self, config: EngineConfig):
        self.config = config

    @property
    def tokenizer(self):
        return self.config.model.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.model.eos_token_ids

    @property
    def generation_defaults(self):
        return self.config.model.generation_defaults

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks in one replica's device pool."""
        return self.config.cache.num_blocks

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def kv_cache(self) -> str:
        return self.config.cache.mode

    @property
    def kv_cache_dtype(self) -> str:
        return self.config.cache.kv_cache_dtype

    @property
    def speculative(self):
        return self.config.speculative

    def get_tokenizer(self):
        """The model's ``paged_jax.text.Tokenizer`` (None without one): ``encode``,
        ``decode``, ``apply_chat_template``, and the raw HF tokenizer as ``.backend``."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` a request gets when the caller gives none: the
        checkpoint's generation_config.json defaults (``generation_config="auto"``),
        else ``SamplingParams()`` (vLLM's ``LLM.get_default_sampling_params``)."""
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in self.generation_defaults.sampling.items() if k in fields})

    def chat_prompt(self, conversation: list[dict], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> str:
        """One conversation rendered as ``chat`` renders it (the text to encode without
        special tokens); a server renders its chat requests with it."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this model has none (no tokenizer.json)")
        text = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=chat_template, **(chat_template_kwargs or {}))
        if continue_final_message:  # cut the template's end-of-turn after the last message
            last = conversation[-1]["content"]
            text = text[: text.rindex(last) + len(last)]
        return text


class LLM(LLMInfo):
    """An offline engine: continuous batching over a paged (or static) KV cache.

    ``LLM(model, **kwargs)``: every keyword is an ``EngineArgs`` field (its docstring says
    what each means). With ``data_parallel_size`` d > 1 (or a mesh whose "data" axis is),
    d engines run side by side, each with its own pool, block manager and scheduler, and
    ``data_parallel_policy`` routes requests; outputs come back in prompt order whichever
    replica ran them.

    JAX's persistent compilation cache is turned on (``paged_jax.compilation_cache``:
    ``~/.cache/paged_jax/jax``; ``PAGED_JAX_COMPILATION_CACHE=<dir>`` or ``=0``), so a
    second process does not compile the engine's programs again.
    """

    def __init__(self, model, **kwargs):
        super().__init__(EngineArgs(model=model, **kwargs).create_engine_config())
        enable_compilation_cache()
        if (pressure := mappings_pressure()) is not None:
            warnings.warn(pressure, stacklevel=2)
        self.engines = [LLMEngine.from_config(self.config, mesh) for mesh in self.config.parallel.replica_meshes()]
        self.router = Router(self.config.parallel.data_parallel_policy, len(self.engines))
        self._next_request = 0
        self._streamed: dict[str, SequenceGroup] = {}  # add_request's, until step() reports them done
        self._sent: dict[str, dict] = {}  # DELTA requests: what step() reported (outputs.delta_output)

    # ------------------------------------------------------------------ what it is

    @property
    def engine(self) -> LLMEngine:
        """The engine (the first replica's, with several)."""
        return self.engines[0]

    @property
    def backend(self):
        return self.engine.runner.backend

    @property
    def data_parallel_size(self) -> int:
        return len(self.engines)

    # ------------------------------------------------------------------ generate

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, *, priority=None) -> list:
        """Run every prompt to completion; outputs in prompt order.

        Args:
          prompts: token-id lists (or 1-D integer arrays), strings (the model has a
            tokenizer), ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}`` dicts with an
            optional ``"cache_salt"`` (prefix caching shares blocks only within one salt),
            or one prompt.
          sampling_params: one ``SamplingParams`` for all, one per prompt, or None
            (``get_default_sampling_params()``). A ``BeamSearchParams`` in the list makes
            that request a beam search (its output is a ``BeamSearchOutput``).
          priority: one int per prompt (lower is admitted sooner under
            ``admission_policy="priority"``), as vLLM's.

        Raises ValueError, before generating anything, for an empty prompt, a token
        outside the vocabulary, a prompt that cannot fit (``>= max_model_len`` tokens), or
        ``n`` or ``beam_width`` above ``max_num_seqs``, naming the request index and the
        limit. A request whose members need more blocks than the whole pool, even sharing
        their prompt, is rejected with a warning naming the limit (``rejected`` on its
        output, no tokens); the other requests complete.
        """
        groups = self.add_requests(prompts, sampling_params, priority=priority)
        try:
            self._run(groups, use_tqdm)
            return self.outputs(groups)
        finally:
            for g in groups:
                self.router.forget(g.request_id)

    def _run(self, groups: list[SequenceGroup], use_tqdm: bool) -> None:
        """Step every busy engine to completion (``router.run_engines``); on any exception
        (Ctrl-C included) every engine is reset and it is re-raised."""
        bar = Progress(groups, self.engines) if use_tqdm else None
        try:
            run_engines([e for e in self.engines if e.has_unfinished()], None if bar is None else bar.update)
        except BaseException:
            for engine in self.engines:
                engine.reset()
            raise
        finally:
            if bar is not None:
                bar.close()

    def warmup(self, use_tqdm: bool = True) -> int:
        """Compile every program a plain (non-speculative, no logprobs) step can call, up
        front: the decode and prefill buckets. Returns how many shapes were run (summed
        over replicas); with the persistent cache warm this is mostly reading back."""
        return sum(e.warmup(use_tqdm=use_tqdm) for e in self.engines)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``), all in one batch:
        ``BeamSearchOutput``s in prompt order (see ``beam.py`` for the rules)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params={params!r}: expected BeamSearchParams")
        return self.generate(prompts, [params] * len(normalise_prompts(prompts, self.tokenizer)), use_tqdm=use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list:
        """Generate replies to conversations (vLLM's ``LLM.chat``): ``messages`` is one
        conversation (a list of ``{"role", "content"}`` dicts) or a list of them, rendered
        with the checkpoint's chat template (or ``chat_template``) in a sandboxed Jinja
        environment as transformers renders it, then generated like text prompts. The
        template writes any BOS itself, so none is added when encoding."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer: this model has none (no tokenizer.json)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message; "
                             "it cannot also add a generation prompt (set add_generation_prompt=False)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs) for c in conversations]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in prompts]
        outs = self.generate([{"prompt_token_ids": i} for i in ids], sampling_params, use_tqdm=use_tqdm)
        return [dataclasses.replace(o, prompt=t) if isinstance(o, RequestOutput) else o
                for o, t in zip(outs, prompts, strict=True)]

    # ------------------------------------------------------------------ requests

    def add_requests(self, prompts, sampling_params=None, *, priority=None) -> list[SequenceGroup]:
        """Validate and queue requests without running them (``generate`` = this, then
        stepping until done). Same arguments and errors as ``generate``; nothing is queued
        if any request is bad. Each goes to the replica the router names."""
        given = normalise_prompts(prompts, self.tokenizer)
        params = intake.params_list(sampling_params, len(given), self.get_default_sampling_params())
        ranks = intake.priorities(priority, len(given))
        rejected = {i: why for i, (prompt, p) in enumerate(zip(given, params, strict=True))
                    if (why := intake.validate(self.config, i, prompt.token_ids, p)) is not None}
        loads = self.router.loads([[g.request_id for g in e.unfinished()] for e in self.engines])
        groups = []
        for i, (prompt, p) in enumerate(zip(given, params, strict=True)):
            number = self._next_request
            self._next_request += 1
            group = intake.make_group(self.config, str(number), i, prompt, p, priority=ranks[i],
                                      rejected=rejected.get(i))
            groups.append(group)
            if group.rejected:
                warnings.warn(group.rejected + "; rejected (its output is empty)", stacklevel=3)
                self.router.record(group.request_id, 0, 0)
                continue
            tokens = intake.cost(prompt.token_ids, p)
            r = self.router.assign(number, tokens, loads)
            self.router.record(group.request_id, r, tokens)
            loads[r] = loads[r]._replace(requests=loads[r].requests + 1, tokens=loads[r].tokens + tokens)
            self.engines[r].add(group)
        return groups

    def add_request(self, prompt, params=None, request_id: str | None = None, *, priority: int = 0) -> str:
        """Queue one request without running it (vLLM's ``LLMEngine.add_request``); returns
        its id. ``step()`` runs the engines one step at a time, for notebooks and servers."""
        if request_id is not None and (not isinstance(request_id, str) or request_id in self._streamed
                                       or request_id in self.router.owner):
            raise ValueError(f"request_id={request_id!r}: must be a new string")
        (group,) = self.add_requests([prompt], None if params is None else [params], priority=[priority])
        if request_id is not None:
            owner, cost = self.router.owner.pop(group.request_id), self.router.cost.pop(group.request_id)
            self.router.record(request_id, owner, cost)
            group.request_id = request_id
            for s in group.seqs:
                s.request_id = request_id
        self._streamed[group.request_id] = group
        return group.request_id

    def step(self) -> list:
        """One step of every engine with work: the outputs of the requests ``add_request``
        queued, as each one's ``SamplingParams.output_kind`` asks: by default the whole
        output so far of every one still running or finished in this step (a finished one is
        reported once); deltas (only requests with news); or final outputs only. An engine left without work releases its last rows here
        (those of requests that finished or were aborted), so an idle engine holds no blocks."""
        for engine in self.engines:
            if engine.has_unfinished():
                engine.step()
            if not engine.has_unfinished():  # the last step's finished (or aborted) rows go back now
                engine.flush()
        outs = []
        for g in list(self._streamed.values()):
            done = is_done(g)
            kind = RequestOutputKind.CUMULATIVE if g.beam is not None else getattr(
                g.params, "output_kind", RequestOutputKind.CUMULATIVE)
            if kind == RequestOutputKind.DELTA:
                engine = self.engines[self.router.owner.get(g.request_id, 0)]
                out = delta_output(g, engine.text, engine.tokenizer, self._sent.setdefault(g.request_id, {}))
                if out is not None:
                    outs.append(out)
            elif kind == RequestOutputKind.CUMULATIVE or done:
                outs.append(self.outputs([g])[0])
            if done:
                del self._streamed[g.request_id]
                self._sent.pop(g.request_id, None)
                self.router.forget(g.request_id)
        return outs

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def abort(self, request_ids) -> None:
        """Abort unfinished requests by id (vLLM's ``abort_request``): their completions end
        with finish reason "abort" and the tokens so far; their blocks are released at the
        next step. ValueError, before anything changes, for an id that is not running."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = {g.request_id: e for e in self.engines for g in e.unfinished()}
        unknown = [r for r in ids if r not in live]
        if unknown:
            raise ValueError(f"unknown request ids (never added, or already finished): {unknown}")
        for engine in self.engines:
            mine = [r for r in dict.fromkeys(ids) if live[r] is engine]
            if mine:
                engine.abort(mine)

    def outputs(self, groups: list[SequenceGroup]) -> list:
        """Each request's output from the engine that ran it, in the given order."""
        return [self.engines[self.router.owner.get(g.request_id, 0)].outputs([g])[0] for g in groups]

    # ------------------------------------------------------------------ stats and inspection

    def stats(self) -> dict:
        """Counters since construction (or ``reset_stats``); see ``stats.py``. With several
        replicas: each one's under "replicas", the additive counters summed."""
        if len(self.engines) == 1:
            return self.engine.summary()
        return merged_summary([e.summary() for e in self.engines], self.config.parallel.tensor_parallel_size)

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up run); the trace counts are kept."""
        for e in self.engines:
            e.reset_stats()

    def usage(self):
        """Requests waiting/running/swapped, blocks used and prefix-cache counts, summed over
        the replicas, read on the host without a device sync (``inspection.EngineUsage``):
        cheap enough for a server to read after every step."""
        total = self.engines[0].usage()
        for e in self.engines[1:]:
            total = total + e.usage()
        return total

    def inspect(self, replica: int = 0):
        """The block manager of one replica as the device holds it now: block tables,
        lengths, reference counts, the free pool, each request's rows, the swap pool
        (``inspection.CacheInspection``). Syncs the device: for tests and notebooks."""
        return self.engines[replica].inspect()
