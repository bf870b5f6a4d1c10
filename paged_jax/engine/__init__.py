"""The serving engine: continuous batching over the paged KV cache, behind vLLM's API.

Data flows one way: ``llm`` (public API: ``EngineArgs`` -> ``EngineConfig``, engines and a
router) -> ``engine`` (the step loop: schedule, run, postprocess) -> ``scheduler``
(decisions; host only; plans each step) -> ``runner`` (the only device code: executes a
step's plan with one device fetch). ``accounting`` is the one place where the paged
engine and the static baseline differ.
"""

# Extension points: the static baseline's accounting, custom models, victim, admission and routing policies.
from paged_jax.backend import ModelBackend, build_backend
from paged_jax.engine.accounting import PagedAccounting, StaticAccounting
from paged_jax.engine.admission import ADMISSION_POLICIES, WaitingInfo, register_admission_policy

# Public offline API (vLLM's names).
from paged_jax.engine.beam import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from paged_jax.engine.config import PREEMPTION_MODES, EngineArgs, EngineConfig
from paged_jax.engine.conversation import Conversation
from paged_jax.engine.engine import LLMEngine
from paged_jax.engine.inspection import CacheInspection, EngineUsage
from paged_jax.engine.llm import LLM
from paged_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.engine.router import ROUTERS, register_router
from paged_jax.engine.sampling import Logprob, RequestOutputKind, SamplingParams, sample
from paged_jax.engine.sequence import SeqInfo, Sequence, SequenceGroup
from paged_jax.engine.speculative import SpeculativeConfig, ngram_propose
from paged_jax.engine.victim import VICTIM_POLICIES, VictimPolicy, get_victim_policy, register_victim_policy

__all__ = [
    "ADMISSION_POLICIES", "LLM", "PREEMPTION_MODES", "ROUTERS", "CacheInspection", "EngineArgs", "EngineUsage", "EngineConfig",
    "LLMEngine", "WaitingInfo", "register_admission_policy", "register_router", "register_victim_policy", "VICTIM_POLICIES", "BeamSearchOutput", "BeamSearchParams",
    "BeamSearchSequence", "CompletionOutput", "Conversation", "ModelBackend",
    "Logprob", "PagedAccounting", "RequestMetrics", "RequestOutput", "RequestOutputKind", "SamplingParams", "SeqInfo", "Sequence", "SequenceGroup",
    "SpeculativeConfig", "StaticAccounting", "VictimPolicy", "build_backend", "get_victim_policy", "ngram_propose",
    "sample",
]
