"""The `rackserve` command: a registry of subcommands (`serve`, `generate`, `chat` here; other
modules add theirs, e.g. `bench ...`, with `register_subcommand`) and the parser built from it.

This file owns command names, their flags beyond the engine's, and terminal output. It must
never import torch or the engine at module level: `rackserve --help` stays instant.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from rackserve.config import EngineArgs
from rackserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rackserve.engine.async_engine import AsyncEngine


@dataclass(frozen=True)
class Subcommand:
    name: str                           # words; "bench forward" nests under a "bench" group
    help: str
    add_args: Callable[[argparse.ArgumentParser], object]
    run: Callable[[argparse.Namespace], int | None]


SUBCOMMANDS: dict[str, Subcommand] = {}
# Modules imported before parsing so that their register_subcommand calls take effect; a module
# that defines subcommands (say rackserve.bench.cli) adds its name here.
COMMAND_MODULES: tuple[str, ...] = ("rackserve.bench.offline", "rackserve.bench.serve_bench", "rackserve.bench.plot",
                                   "rackserve.bench.forward", "rackserve.serve.worker_cli", "rackserve.bench.gate",
                                   "rackserve.bench.comm", "rackserve.bench.overload", "rackserve.sim.cli",
                                   "rackserve.router.pd_proxy", "rackserve.kv_transfer.pool_cli",
                                   "rackserve.bench.kv_transfer_bench", "rackserve.bench.kv_pool_bench",
                                   "rackserve.router.cli", "rackserve.router.cluster", "rackserve.bench.router_bench",
                                   "rackserve.bench.prefix_replay", "rackserve.bench.pd_itl_bench",
                                   "rackserve.bench.gemv_bench")


def register_subcommand(name: str, help: str, add_args: Callable[[argparse.ArgumentParser], object]):
    """Decorator for `run(args) -> exit code | None`, registering it as `rackserve <name>`."""
    def wrap(run: Callable[[argparse.Namespace], int | None]):
        assert name not in SUBCOMMANDS, f"subcommand {name!r} registered twice"
        SUBCOMMANDS[name] = Subcommand(name, help, add_args, run)
        return run
    return wrap


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rackserve", description="A small, readable LLM server.")
    groups = {(): parser.add_subparsers(dest="command", required=True, metavar="COMMAND")}
    for name in sorted(SUBCOMMANDS):
        command, words = SUBCOMMANDS[name], tuple(name.split())
        for depth in range(1, len(words)):
            prefix = words[:depth]
            if prefix not in groups:
                group = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{' '.join(prefix)} commands")
                groups[prefix] = group.add_subparsers(required=True, metavar="COMMAND")
        assert words not in groups, f"{name!r} is both a command and a group"
        sub = groups[words[:-1]].add_parser(words[-1], help=command.help, description=command.help)
        command.add_args(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


@contextlib.contextmanager
def _user_errors(command: str) -> Iterator[None]:
    """Bad option values (SamplingParams' and the engine config's ValueError, a model path that
    does not exist) end the command with their message and exit code 2, not a traceback; workers
    that fail (a configuration they refuse, a rank that died) with theirs and exit code 1."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        print(f"rackserve {command}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as e:
        from rackserve.executor.worker import WorkerError   # torch is loaded by now
        if not isinstance(e, WorkerError):
            raise
        print(f"rackserve {command}: {e}", file=sys.stderr)
        raise SystemExit(1) from None


# ---- serve --------------------------------------------------------------------------------


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    from rackserve.serve.http_server import add_header_timeout_arg
    from rackserve.serve.limits import ServerLimits
    EngineArgs.add_cli_args(parser)
    limits = parser.add_argument_group("request limits")
    ServerLimits.add_cli_args(limits)
    add_header_timeout_arg(limits)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds that requests in flight get to finish after SIGTERM/SIGINT before "
                             "they are aborted (new requests get 503 meanwhile); the engine's step in progress "
                             "then gets as long again before the process exits without it")


@register_subcommand("serve", "serve the OpenAI-compatible API over HTTP", _add_serve_args)
def _serve(args: argparse.Namespace) -> None:
    from rackserve.serve.launch import run_server
    with _user_errors("serve"):
        run_server(args)


# ---- generate and chat ---------------------------------------------------------------------


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Request-level sampling flags; --seed is the engine's (it seeds requests without their own)."""
    EngineArgs.add_cli_args(parser)
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    group.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0: all tokens")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos)


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template")
    _add_sampling_args(parser)


@register_subcommand("generate", "generate one completion offline and print it", _add_generate_args)
def _generate(args: argparse.Namespace) -> int:
    from rackserve import LLM
    with _user_errors("generate"):
        params = _sampling_params(args)
        with LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args))) as llm:
            start = time.perf_counter()
            if args.chat:
                out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
            else:
                out = llm.generate([args.prompt], params)[0]
            seconds = time.perf_counter() - start
    completion = out.outputs[0]
    print(completion.text)
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} generated "
          f"in {seconds:.2f} s, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system prompt opening the conversation")
    _add_sampling_args(parser)


@register_subcommand("chat", "chat with the model in the terminal, streaming its replies", _add_chat_args)
def _chat(args: argparse.Namespace) -> int:
    from rackserve.engine.async_engine import AsyncEngine
    with _user_errors("chat"):
        params = _sampling_params(args)
        if args.skip_tokenizer_init:
            raise ValueError("chat needs the tokenizer's chat template; drop --skip-tokenizer-init")
        engine = AsyncEngine(EngineArgs.from_cli_args(args))
    history = [{"role": "system", "content": args.system}] if args.system else []
    # One loop for the whole session, run only while a reply streams: input() runs outside it,
    # so Ctrl-C at the prompt quits and Ctrl-C during a reply cancels (and aborts) just that reply.
    loop = asyncio.new_event_loop()
    print("Chatting with", engine.config.model.served_model_name,
          "- Ctrl-D or /exit quits, /reset clears the history, Ctrl-C stops a reply.")
    try:
        while True:
            try:
                line = input("\n> ").strip()
            except (EOFError, KeyboardInterrupt):
                break
            if line == "/exit":
                break
            if line == "/reset":
                del history[int(bool(args.system)):]
                continue
            if not line:
                continue
            history.append({"role": "user", "content": line})
            reply = loop.create_task(_stream_reply(engine, history, params))
            try:
                text = loop.run_until_complete(reply)
            except KeyboardInterrupt:
                reply.cancel()
                text = loop.run_until_complete(reply)
            if text is None:
                history.pop()
            else:
                history.append({"role": "assistant", "content": text})
    finally:
        print()
        loop.close()
        engine.shutdown()
    return 0


async def _stream_reply(engine: AsyncEngine, history: list[dict[str, str]],
                        params: SamplingParams) -> str | None:
    """Prints the reply as it streams; returns its text (so far, when cancelled), or None when
    the engine refused the conversation."""
    prompt = engine.tokenizer.apply_chat_template(history)
    request_id = f"chat-{uuid.uuid4().hex}"
    text = ""
    try:
        async for out in engine.generate(prompt, params, request_id):
            delta = out.outputs[0].text
            text += delta
            print(delta, end="", flush=True)
    except asyncio.CancelledError:
        engine.abort(request_id)
        print(" [stopped]", end="", flush=True)
    except ValueError as e:  # the conversation outgrew the context: say so and keep chatting
        print(f"[{e}; /reset to start over]", flush=True)
        return None
    print()
    return text


if __name__ == "__main__":
    # Run the registry of the importable module, not of this `__main__` copy, so that commands
    # other modules register (into rackserve.serve.cli.SUBCOMMANDS) are found.
    from rackserve.serve.cli import main as _main
    sys.exit(_main())
