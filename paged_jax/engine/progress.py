"""``LLM.generate``'s progress bar: requests done, output tokens/s, and the phase
("compiling" while the last step compiled a program, so a first call's minute of XLA work
is named)."""

from __future__ import annotations

from paged_jax.engine.outputs import is_done


class Progress:
    def __init__(self, groups: list, engines: list):
        from tqdm.auto import tqdm

        self.groups, self.engines = groups, engines
        self.tokens0 = self._tokens()
        self.compiled = self._compiled()
        self.bar = tqdm(total=len(groups), desc="compiling", unit="req", dynamic_ncols=True)

    def _tokens(self) -> int:
        return sum(e.stats.generated_tokens for e in self.engines)

    def _compiled(self) -> float:
        return sum(e.runner.compile_seconds for e in self.engines)

    def update(self) -> None:
        compiled = self._compiled()
        self.bar.set_description("compiling" if compiled > self.compiled else "generating", refresh=False)
        self.compiled = compiled
        tokens = self._tokens() - self.tokens0
        elapsed = self.bar.format_dict["elapsed"]
        self.bar.set_postfix_str(f"{tokens} tokens, {tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        self.bar.update(sum(is_done(g) for g in self.groups) - self.bar.n)

    def close(self) -> None:
        self.bar.set_description("generated", refresh=False)
        self.bar.close()
