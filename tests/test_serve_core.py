"""The engine core (``serve/core.py``) on the fake model, without HTTP: what it reports for
adds, finishes, aborts, a refused add, a step that raises and a stop, as every placement
relies on; and the streams of the in-process placements (stepped on the caller's loop,
``InlineEngine``, or on a thread, ``AsyncEngine``) raising ``EngineError`` when a step
fails and yielding what their output kind asks."""

import asyncio

import pytest
from engine_fakes import fake_backend

from paged_jax import LLM, RequestOutputKind, SamplingParams
from paged_jax.engine.outputs import OutputAccumulator
from paged_jax.serve.async_engine import AsyncEngine, InlineEngine
from paged_jax.serve.core import EngineCore, EngineError, Overloaded

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PLACEMENTS = [InlineEngine, AsyncEngine]


def _serve(placement, llm, body):
    """Run ``await body(engine)`` with a ``placement`` engine on ``llm`` started on the
    loop, then wait (off the loop) for it to go idle and stop it: body's result, the engine."""
    engine = placement(llm)

    async def main():
        engine.start()
        try:
            got = await body(engine)
            assert await asyncio.to_thread(engine.wait_idle, 60)
            assert engine.usage().blocks_used == 0
            return got
        finally:
            await asyncio.to_thread(engine.shutdown)
            assert not engine.alive

    return asyncio.run(asyncio.wait_for(main(), 120)), engine


@pytest.fixture
def llm():
    return LLM(fake_backend(4), block_size=4, num_gpu_blocks=32, max_model_len=32, max_num_seqs=2,
               max_num_batched_tokens=16)


def _run(core, script):
    """Feed ``script`` (a list of command batches, one per ``commands`` call; then stop) to
    ``core.run``; the reports it sent."""
    reports, batches = [], list(script)

    def commands(timeout):
        return batches.pop(0) if batches else [("stop",)]

    core.run(commands, reports.append)
    return reports


def _fail_next_step(llm):
    """The engine's next step raises inside (the engine resets itself, as for any error)."""
    engine, real = llm.engine, llm.engine._step

    def broken():
        engine._step = real
        raise RuntimeError("boom")

    engine._step = broken


def test_reports_outputs_finish_and_idle(llm):
    core = EngineCore(llm)
    reports = _run(core, [[("add", "a", [1, 2, 3], GREEDY), ("add", "b", [4, 5], GREEDY)]] + [[]] * 8)
    assert reports[0].applied == 2 and reports[0].adds == 2 and not reports[0].idle
    finals = {o.request_id: o for r in reports for o in r.outputs if o.finished}
    want = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
    assert [finals[k].outputs[0].token_ids for k in "ab"] == [w.outputs[0].token_ids for w in want]
    done = next(i for i, r in enumerate(reports) if r.idle)
    assert reports[done].usage.blocks_used == 0 and not core.live
    assert reports[-1].failed == (reports[-1].failed[0], []) and isinstance(reports[-1].failed[0], Overloaded)


def test_abort_drops_its_outputs_and_releases_its_blocks(llm):
    core = EngineCore(llm)
    reports = _run(core, [[("add", "a", [1, 2, 3], GREEDY)], [("abort", "a")], []])
    assert reports[0].outputs and reports[0].usage.blocks_used > 0
    assert reports[1].applied == 1 and not reports[1].outputs  # the abort's step: nothing reported for "a"
    assert reports[1].idle and reports[1].usage.blocks_used == 0


def test_a_refused_add_is_reported_and_a_failed_step_fails_the_live_requests(llm):
    core = EngineCore(llm)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reports = _run(core, [[("add", "a", [1, 2], long)], [("add", "a", [3], long)]])  # "a" again: refused
    assert reports[1].rejected[0][0] == "a" and isinstance(reports[1].rejected[0][1], ValueError)
    assert reports[-1].failed[1] == ["a"] and isinstance(reports[-1].failed[0], Overloaded)  # the stop

    core = EngineCore(llm)
    _fail_next_step(llm)
    reports = _run(core, [[("add", "b", [1, 2], long)], [("add", "c", [3, 4], GREEDY)], [], [], [], [], [], []])
    error, ids = reports[0].failed
    assert isinstance(error, EngineError) and "boom" in str(error) and ids == ["b"] and core.errors == 1
    assert reports[0].idle and reports[0].usage.blocks_used == 0
    assert any(o.request_id == "c" and o.finished for r in reports for o in r.outputs)  # the next one runs


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_streams_raise_engine_error_when_a_step_fails(llm, placement):
    async def body(engine):
        _fail_next_step(llm)
        with pytest.raises(EngineError, match="boom"):
            async for _ in engine.submit([1, 2, 3], GREEDY):
                pass
        outs = [o async for o in engine.submit([1, 2, 3], GREEDY)]
        return outs[-1]

    last, _ = _serve(placement, llm, body)
    assert last.finished and len(last.outputs[0].token_ids) == 5


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_streams_yield_what_their_output_kind_asks(llm, kind, placement):
    """The core reports deltas whatever the caller asked; the caller's side gives a DELTA
    stream deltas (concatenating to the whole output), a FINAL_ONLY stream one output, a
    CUMULATIVE stream growing whole outputs; the metrics count every token either way."""
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=6 + s, n=2, ignore_eos=True, output_kind=kind)
              for s in range(3)]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    want = llm.generate(prompts, params, use_tqdm=False)

    async def body(engine):
        async def one(p, sp):
            return [o async for o in engine.submit(p, sp)]

        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params, strict=True)))

    got, engine = _serve(placement, llm, body)
    for outs, w in zip(got, want, strict=True):
        whole = [(c.index, c.token_ids, c.finish_reason) for c in w.outputs]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        if kind == RequestOutputKind.DELTA:
            acc = OutputAccumulator()
            for o in outs:
                assert sum(len(c.token_ids) for c in o.outputs) <= 2 * 2  # a step's news, merged at most once
                acc.add(o)
            last = acc.output()
        elif kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
            last = outs[0]
        else:
            sizes = [sum(len(c.token_ids) for c in o.outputs) for o in outs]
            assert sizes == sorted(sizes) and len(outs) > 1
            last = outs[-1]
        assert [(c.index, c.token_ids, c.finish_reason) for c in last.outputs] == whole
        assert last.prompt_token_ids == w.prompt_token_ids
    text = engine.metrics.render().decode()
    generated = sum(len(c.token_ids) for w in want for c in w.outputs)
    assert f"generation_tokens_total {float(generated)}" in text.replace("paged_jax:", "")


def test_inline_request_read_during_a_step_joins_the_next_step(llm):
    """A request whose bytes arrive during a step is read in the loop's next pass, where the
    read queues its handler's task behind whatever that pass already holds; the turn waits one
    pass (``InlineEngine._admit``) so that task submits before the next step, not the one after
    (stepping first cost the request a whole step of TTFT). Emulated: after the second turn a
    callback due before the next turn creates a task that submits a request, as uvicorn's read
    creates the handler's task."""
    engine = InlineEngine(llm)
    seen, hooked = [], []
    real_turn = engine.core.turn
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def body(engine):
        loop = asyncio.get_running_loop()

        def turn(commands):
            seen.append([c[0] for c in commands])
            got = real_turn(commands)
            if len(seen) == 2:  # "bytes arrived during this step": read in the next pass
                loop.call_at(loop.time() - 1, lambda: hooked.append(loop.create_task(submit_late())))
            return got

        async def submit_late():
            return [out async for out in engine.submit([3, 4], GREEDY)]

        engine.core.turn = turn
        first = [out async for out in engine.submit([1, 2, 3], long)]
        return first, await hooked[0]

    (first, late), _ = _serve(lambda _: engine, llm, body)
    assert late[-1].finished and first[-1].finished
    assert seen[2] == ["add"], seen[:4]  # the very next turn took the late request's add
