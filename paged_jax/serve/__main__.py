"""``python -m paged_jax.serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY]
[--served-model-name NAME] [--max-waiting N] [--engine inline|process|thread] [any LLM option]``.

Every ``EngineArgs`` field is an option with dashes (``--max-num-seqs 32``,
``--enable-prefix-caching``, ``--no-share-blocks``, ``--speculative-config '{"method":
"ngram", "num_speculative_tokens": 4}'``): ints and floats as such, booleans as flags,
dicts and policy arguments as JSON (else the string).

Where the engine core runs (``--engine``): ``inline`` (the default) on the server's asyncio
loop between the HTTP callbacks (``InlineEngine``: no hand-over between threads or processes
on a streamed token's way: the least added latency at low load, about the same throughput
under load); ``process`` in a process of its own (``ProcessEngine``: the HTTP side's Python
runs beside the step, at a pipe and two wake-ups a step); ``thread`` on a thread of the
server process (``AsyncEngine``, sharing its GIL). Measured: docs/results/notes/serving.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

SWITCH_INTERVAL = 0.005  # Python's default
ENGINES = ("inline", "process", "thread")  # where the engine core runs; the first is the default (measured:
# docs/results/notes/serving.md)
_SERVER_ONLY = ("model", "mesh")  # not options: the positional model; a Mesh has no command-line form


def _json_or_str(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _converter(annotation: str):
    kinds = {part.strip() for part in str(annotation).split("|")} - {"None"}
    if kinds == {"int"}:
        return int
    if kinds == {"float"}:
        return float
    if kinds == {"str"} or kinds == {"str", "os.PathLike"}:
        return str
    return _json_or_str


def parser() -> argparse.ArgumentParser:
    from paged_jax.engine.config import EngineArgs

    p = argparse.ArgumentParser(prog="python -m paged_jax.serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="a checkpoint directory (or anything LLM(model) opens)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--max-waiting", type=int, default=512, help="queued requests beyond which new ones get 503")
    p.add_argument("--log-level", default="info")
    p.add_argument("--timeout-keep-alive", type=float, default=None,
                   help="seconds an idle keep-alive connection stays open (default: server.KEEP_ALIVE_S, longer "
                        "than the clients' own idle expiry)")
    p.add_argument("--no-warmup", action="store_true", help="do not compile the decode/prefill programs up front")
    p.add_argument("--switch-interval", type=float,
                   default=float(os.environ.get("PAGED_JAX_SWITCH_INTERVAL", SWITCH_INTERVAL)),
                   help="sys.setswitchinterval for the server process, s: how long the HTTP loop can wait "
                        "for the GIL while the engine thread holds it (Python's default is 0.005)")
    p.add_argument("--engine", choices=ENGINES, default=ENGINES[0],
                   help="where the engine core runs: on the server's asyncio loop between the HTTP callbacks "
                        "(inline: the least added latency at low load), in a process of its own (process), or on "
                        "a thread of the server process sharing its GIL (thread)")
    engine = p.add_argument_group("engine (LLM / EngineArgs options)")
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SERVER_ONLY:
            continue
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) == "bool":
            engine.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            engine.add_argument(flag, dest=f.name, type=_converter(f.type), default=f.default)
    return p


def main(argv: list[str] | None = None) -> None:
    from paged_jax.engine.config import EngineArgs
    from paged_jax.engine.llm import LLM
    from paged_jax.serve.server import serve

    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    engine_kw = {k: v for k, v in vars(args).items() if k in defaults and k != "model" and v != defaults[k]}
    if not args.switch_interval > 0:
        raise ValueError(f"--switch-interval {args.switch_interval}: must be > 0")
    sys.setswitchinterval(args.switch_interval)
    app_kw = dict(log_level=args.log_level, model_name=args.served_model_name or args.model, api_key=args.api_key,
                  max_waiting=args.max_waiting)
    if args.timeout_keep_alive is not None:
        if not args.timeout_keep_alive > 0:
            raise ValueError(f"--timeout-keep-alive {args.timeout_keep_alive}: must be > 0")
        app_kw["timeout_keep_alive"] = args.timeout_keep_alive
    if args.engine == "process":
        from paged_jax.serve.engine_process import ProcessEngine

        engine = ProcessEngine(args.model, engine_kw, warmup=not args.no_warmup, max_waiting=args.max_waiting)
        try:
            serve(None, args.host, args.port, engine=engine, **app_kw)
        finally:
            engine.shutdown()  # already stopped after a drain; here for a server that failed to start
        return
    from paged_jax.serve.async_engine import AsyncEngine, InlineEngine

    llm = LLM(args.model, **engine_kw)
    if not args.no_warmup:
        llm.warmup(use_tqdm=False)
    placement = InlineEngine if args.engine == "inline" else AsyncEngine
    serve(None, args.host, args.port, engine=placement(llm, max_waiting=args.max_waiting), **app_kw)

if __name__ == "__main__":
    main()
