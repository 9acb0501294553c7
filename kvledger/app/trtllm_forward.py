"""`kvledger trtllm-forward`: TensorRT-LLM's pull API published as vLLM-format ZMQ (kvledger/engines/trtllm_forwarder.py).

The forwarder must run in the process that holds the `LLM`: `--llm MODULE:CALLABLE` names a
function of yours that builds it (or returns any object with `get_kv_cache_events_async`); the
command then polls it until SIGINT or SIGTERM. Serving code that owns its LLM calls
`engines.trtllm_forwarder.forward_kv_events(llm, forwarder, stop=...)` itself instead.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect

from kvledger.core.settings import LoadedSettings


class LlmFactoryError(ValueError):
    """`--llm` does not name a callable that builds an LLM."""


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llm", required=True, metavar="MODULE:CALLABLE",
                        help="your function that returns the tensorrt_llm.LLM (built with kv_cache_config.event_buffer_max_size > 0)")
    parser.add_argument("--endpoint", default="tcp://*:5557", metavar="URL",
                        help="PUB socket of attention-DP rank 0; rank r binds port + r (default tcp://*:5557)")
    parser.add_argument("--replay", default="tcp://*:5558", metavar="URL",
                        help="replay ROUTER of rank 0; rank r binds port + r ('' for none; default tcp://*:5558)")
    parser.add_argument("--block-size", type=int, required=True, metavar="N", help="tokens_per_block of the engine")
    parser.add_argument("--attention-dp-size", type=int, default=1, metavar="N",
                        help="attention-DP ranks to bind from the start (default 1)")
    parser.add_argument("--max-window", type=int, metavar="TOKENS",
                        help="the full-attention window (default: the largest in the engine's created events)")
    parser.add_argument("--topic", default="kv-events", help="ZMQ topic (default kv-events)")
    parser.add_argument("--buffer-steps", type=int, default=10_000, metavar="N", help="batches kept for replay")
    parser.add_argument("--poll-timeout", type=float, default=0.5, metavar="S",
                        help="timeout of each get_kv_cache_events_async call")


def build_llm(spec: str) -> object:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise LlmFactoryError(f"--llm {spec!r}: expected MODULE:CALLABLE")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise LlmFactoryError(f"--llm {spec!r}: {error}") from None
    if not callable(factory):
        raise LlmFactoryError(f"--llm {spec!r} is not callable")
    return factory()


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Forward the LLM's KV-cache events until stopped (exit 0), 2 when --llm or the sockets are unusable."""
    from kvledger.engines.trtllm_forwarder import TrtllmForwarder, forward_kv_events
    from kvledger.runtime.entry import run_stage
    from kvledger.runtime.system import install_stop_signals

    async def serve() -> None:
        llm = build_llm(args.llm)
        if inspect.isawaitable(llm):
            llm = await llm
        if not hasattr(llm, "get_kv_cache_events_async"):
            raise LlmFactoryError(f"--llm {args.llm!r} returned {type(llm).__name__}, without get_kv_cache_events_async")
        stop = asyncio.Event()
        install_stop_signals(stop)
        async with TrtllmForwarder(
            args.endpoint, args.replay or None, block_size=args.block_size, attention_dp_size=args.attention_dp_size,
            max_window=args.max_window, topic=args.topic.encode(), buffer_steps=args.buffer_steps,
        ) as forwarder:
            print(f"kvledger trtllm-forward: publishing on {forwarder.endpoints(0)[0]}", flush=True)
            await forward_kv_events(llm, forwarder, stop=stop, poll_timeout_s=args.poll_timeout)

    import zmq

    return run_stage("trtllm-forward", serve, refusals=(LlmFactoryError, zmq.ZMQError, ValueError))
