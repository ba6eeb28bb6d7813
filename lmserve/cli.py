"""The ``lmserve`` command line.

Subcommands:
    ``lmserve chat``: an interactive chat with a model in the terminal (see ``lmserve.frontend.chat_cli``).
    ``lmserve serve``: an OpenAI-compatible HTTP server (see ``lmserve.frontend.server`` and docs/server.md).
    ``lmserve bench``: a serving benchmark against such a server (see ``lmserve.bench``).
    ``lmserve plan``: the engine's batch, KV and memory plan, without loading the weights.
    ``lmserve compile``: a model library, served with ``--model-lib`` (see ``lmserve.library``).

Every subcommand that starts an engine takes one flag per ``EngineConfig`` field
(``engine_args.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional, TypeVar

from lmserve.bench.cli import add_bench_parser
from lmserve.config import EngineConfig
from lmserve.engine.engine import Engine, EngineBase
from lmserve.engine_args import add_engine_args, engine_config_from_args, flag_name
from lmserve.errors import InvalidRequestError
from lmserve.frontend.chat_cli import run_chat
from lmserve.frontend.openai.protocol import ChatCompletionRequest
from lmserve.frontend.server.settings import ServerSettings
from lmserve.generation_defaults import MODES

_E = TypeVar("_E", bound=EngineBase)

def _sampling_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The chat's sampling flags as request fields, checked now so that a bad value is
    reported before the model spends seconds loading."""
    options = {name: value for name, value in (
        ("temperature", args.temperature), ("top_p", args.top_p),
        ("max_tokens", args.max_tokens), ("seed", args.seed)) if value is not None}
    probe = {"messages": [{"role": "user", "content": "probe"}], **options}
    try:
        ChatCompletionRequest.parse(probe).to_sampling_params(None)
    except InvalidRequestError as err:
        if err.param not in options:
            parser.error(err.message)
        # pydantic's messages already start with the field ("temperature: Input should be..").
        message = err.message.removeprefix(f"{err.param}: ")
        parser.error(f"argument {flag_name(err.param)}: {message}")
    return options


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    try:
        return engine_config_from_args(args)
    except ValueError as err:
        parser.error(str(err))


def _add_generation_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--generation-config", choices=MODES, default="auto",
                        help="sampling defaults for what a request leaves unset: 'auto' takes the "
                             "model's (generation_config.json; llama.cpp's for a GGUF file), 'none' "
                             "leaves OpenAI's (temperature 1, top_p 1) (default: %(default)s)")


def _load(engine_class: type[_E], config: EngineConfig, parser: argparse.ArgumentParser,
          generation_config: str = "auto") -> _E:
    """Load the engine; a model or config it cannot serve ends the command (status 1)."""
    print(f"loading {config.model_lib or config.model or 'the built-in model'}...", file=sys.stderr, flush=True)
    try:
        return engine_class(config=config, generation_config=generation_config)
    except (NotImplementedError, OSError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(file=sys.stderr)
        raise SystemExit(130) from None


def _run_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _config(args, parser)
    options = _sampling_options(args, parser)
    engine = _load(Engine, config, parser, args.generation_config)
    try:
        return run_chat(engine, system=args.system, options=options)
    finally:
        engine.shutdown()


def _add_chat(commands: Any) -> None:
    chat = commands.add_parser("chat", help="chat with a model in the terminal",
                               description="Chat with a model in the terminal. Type /help in "
                                           "the chat for its commands.")
    sampling = chat.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, metavar="T",
                          help="sampling temperature, 0 = greedy (default: the model's sampling "
                               "defaults, see lmserve plan)")
    sampling.add_argument("--top-p", type=float, metavar="P",
                          help="nucleus sampling: keep the top tokens of this probability mass "
                               "(default: the model's sampling defaults)")
    sampling.add_argument("--max-tokens", type=int, metavar="N",
                          help="most tokens per answer (default: what the context leaves)")
    sampling.add_argument("--seed", type=int, metavar="S",
                          help="random seed, for repeatable sampling (default: none)")
    chat.add_argument("--system", metavar="TEXT",
                      help="system prompt (default: the model's chat template decides)")
    _add_generation_config(chat)
    # The engine's log would interleave with the conversation, so chat is quiet unless asked.
    add_engine_args(chat, defaults={"verbose": False})
    chat.set_defaults(handler=_run_chat, parser=chat)


def _run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _config(args, parser)
    try:
        settings = ServerSettings(
            host=args.host, port=args.port, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
            max_waiting=args.max_waiting, max_waiting_tokens=args.max_waiting_tokens,
            max_seqs_per_request=args.max_seqs_per_request, max_stop_chars=args.max_stop_chars,
            served_model_name=args.served_model_name, shutdown_grace=args.shutdown_grace,
            header_timeout=args.header_timeout, body_timeout=args.body_timeout,
            keep_alive_timeout=args.keep_alive_timeout)
    except ValueError as err:
        parser.error(str(err))
    _place_hosts(args)
    if config.model_lib is not None:  # the library's parallel split decides the ranks
        from lmserve.library.library import ModelLibrary

        try:
            config = ModelLibrary.open(config.model_lib, config.model).apply(config)
        except (OSError, ValueError) as err:
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
            return 1
    from lmserve.parallel.group import world_size
    from lmserve.parallel.placement import placement

    try:
        rank = placement(world_size(config)).rank
    except ValueError as err:
        parser.error(str(err))
    if rank != 0:  # another host's ranks (or torchrun's): they compute, rank 0 serves
        from lmserve.parallel.rank import serve_host_ranks

        return serve_host_ranks(config)
    # FastAPI and uvicorn load only for this command.
    from lmserve.engine.async_engine import AsyncEngine
    from lmserve.frontend.server.run import serve

    engine = _load(AsyncEngine, config, parser, args.generation_config)
    # The server handles SIGTERM and SIGINT while it runs (a drain, exit 0) and puts back the
    # handlers it found when it stops. Before it runs, they end the process with status 0; once
    # it has stopped they are ignored, so that a late signal cannot kill the process (status
    # 143) on its way out. Not a Python handler there: Python resets those to the default at exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_0)
    try:
        serve(engine, settings, log_level=args.log_level)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        engine.shutdown()  # serve already did, unless it failed to start (at most 10 s)
    return 0


def _place_hosts(args: argparse.Namespace) -> None:
    """Hand --nnodes and the others to the engine's ranks the way torchrun hands its own: in
    the environment (``lmserve.parallel.placement``)."""
    if args.nnodes != 1 or args.node_rank != 0:
        os.environ["LMSERVE_NNODES"] = str(args.nnodes)
        os.environ["LMSERVE_NODE_RANK"] = str(args.node_rank)
    os.environ.setdefault("MASTER_ADDR", args.master_addr)
    if args.master_port is not None:
        os.environ["MASTER_PORT"] = str(args.master_port)


def _exit_0(sig: int, frame: Any) -> None:
    raise SystemExit(0)


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models), plus /tokenize, /detokenize, /health and /metrics. SIGTERM or "
                    "Ctrl-C drains the server: new requests get 503 while running ones finish.")
    d = ServerSettings()
    http = serve.add_argument_group("server")
    http.add_argument("--host", default=d.host,
                      help="address to listen on; 0.0.0.0 exposes the server to the network, which "
                           "has no TLS (default: %(default)s)")
    http.add_argument("--port", type=int, default=d.port, help="TCP port (default: %(default)s)")
    http.add_argument("--api-key", metavar="KEY", default=os.environ.get("LMSERVE_API_KEY") or None,
                      help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                           "(default: $LMSERVE_API_KEY, which keeps the key out of the process list; "
                           "unset: no key)")
    http.add_argument("--max-body-bytes", type=int, metavar="N", default=d.max_body_bytes,
                      help="larger request bodies get 413 (default: %(default)s)")
    http.add_argument("--max-waiting", type=int, metavar="N", default=d.max_waiting,
                      help="sequences (prompts x n) of the generation requests in flight before new "
                           "ones get 429 (default: %(default)s)")
    http.add_argument("--max-waiting-tokens", type=int, metavar="N", default=d.max_waiting_tokens,
                      help="prompt tokens (times n) in flight before new requests get 429 "
                           "(default: four times what the KV cache holds)")
    http.add_argument("--max-seqs-per-request", type=int, metavar="N", default=d.max_seqs_per_request,
                      help="sequences (prompts x n) one request may start, which also bounds its "
                           "list of prompts; more get 400; those past the batch (--max-num-sequence) "
                           "queue (default: 128, OpenAI's limit on n)")
    http.add_argument("--max-stop-chars", type=int, metavar="N", default=d.max_stop_chars,
                      help="characters of a request's stop strings together; more get 400 "
                           "(default: %(default)s)")
    http.add_argument("--served-model-name", metavar="NAME",
                      help="the model name clients send and see (default: the model's file or "
                           "directory name)")
    http.add_argument("--shutdown-grace", type=float, metavar="S", default=d.shutdown_grace,
                      help="seconds running requests get to finish after SIGTERM (default: %(default)s)")
    http.add_argument("--header-timeout", type=float, metavar="S", default=d.header_timeout,
                      help="seconds a connection gets to send a request's headers, from its opening "
                           "or its previous answer; then it is closed (default: %(default)s)")
    http.add_argument("--body-timeout", type=float, metavar="S", default=d.body_timeout,
                      help="seconds to receive a request's whole body, else 408 (default: %(default)s)")
    http.add_argument("--keep-alive-timeout", type=float, metavar="S", default=d.keep_alive_timeout,
                      help="seconds an idle connection stays open after an answer (default: %(default)s)")
    http.add_argument("--log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug", "trace"],
                      help="uvicorn's log level; 'warning' drops the access log (default: %(default)s)")
    hosts = serve.add_argument_group(
        "hosts", "a parallel engine over several hosts (--tensor-parallel-shards and "
                 "--pipeline-parallel-stages): the same command on each, with its --node-rank; "
                 "node 0 serves HTTP, the others only compute (torchrun's RANK, WORLD_SIZE, "
                 "MASTER_ADDR and MASTER_PORT work too)")
    hosts.add_argument("--nnodes", type=int, metavar="K", default=1, help="hosts (default: 1)")
    hosts.add_argument("--node-rank", type=int, metavar="R", default=0,
                       help="this host's place, 0..K-1 (default: 0)")
    hosts.add_argument("--master-addr", metavar="A", default="127.0.0.1",
                       help="node 0's address, where the ranks meet (default: %(default)s)")
    hosts.add_argument("--master-port", type=int, metavar="P",
                       help="a free TCP port on node 0 for the ranks to meet (needed with "
                            "--nnodes > 1; default: any free port)")
    add_engine_args(serve)
    _add_generation_config(serve)
    serve.set_defaults(handler=_run_serve, parser=serve)


def _run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _config(args, parser)
    # Reads the model's hyper-parameters only: no weights are loaded.
    from lmserve.models.source import open_model
    from lmserve.plan import make_plan
    from lmserve.speculative.draft_model import draft_opt, read_draft_model
    from lmserve.speculative.eagle_heads import eagle_head_args

    try:
        config, source = open_model(config)
        model = source.args
        draft = read_draft_model(config, model)
        plan = make_plan(config, model, draft_args=(draft and draft.args) or eagle_head_args(config, model),
                         draft_opt=draft_opt(config, draft) if draft is not None else None,
                         stage_layers_given=source.stage_layers)
        defaults = source.generation_defaults(args.generation_config)
    except (OSError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"model  {source.describe()} ({model.architecture}, {model.num_layers} layers, "
          f"context {model.context_length})")
    print(plan.describe())
    print(defaults.describe())
    return 0


def _add_plan(commands: Any) -> None:
    plan = commands.add_parser(
        "plan", help="print the batch, KV cache and memory plan without loading the weights",
        description="Print what the engine would use for this model and these flags: batch size, "
                    "KV cache capacity, prefill chunk, weight and KV dtypes (from --opt), and the "
                    "memory it expects against the budget. No weights are loaded.")
    add_engine_args(plan)
    _add_generation_config(plan)
    plan.set_defaults(handler=_run_plan, parser=plan)


def _run_compile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    config = _config(args, parser)
    from lmserve.library.compile import compile_library

    started = time.perf_counter()
    print(f"compiling {config.model or 'the built-in model'} into {args.output}...", file=sys.stderr,
          flush=True)
    try:
        info = compile_library(config, args.output, lambda line: print(line, file=sys.stderr, flush=True))
    except (OSError, ValueError, RuntimeError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    size = sum(f["size"] for f in info.files.values())
    print(f"wrote {args.output} ({size / 2**20:.1f} MiB, {len(info.files)} files) in "
          f"{time.perf_counter() - started:.1f} s; serve it with: lmserve serve --model-lib {args.output}")
    return 0


def _add_compile(commands: Any) -> None:
    compile_ = commands.add_parser(
        "compile", help="compile a model into a library that starts without preparing anything",
        description="Write a model library: the weights prepared for --opt (and split for "
                    "--tensor-parallel-shards / --pipeline-parallel-stages), the C++ kernels "
                    "built for this CPU, the tokenizer and chat template. Serve it with "
                    "--model-lib DIR; opt and the parallel split then come from the library. "
                    "The other engine flags are for serving and are not stored.")
    compile_.add_argument("--output", required=True, metavar="DIR",
                          help="the library's directory (must not exist yet)")
    add_engine_args(compile_, defaults={"verbose": False})
    compile_.set_defaults(handler=_run_compile, parser=compile_)


def build_parser() -> argparse.ArgumentParser:
    """The ``lmserve`` parser with all its subcommands; each sets ``handler(args, parser)``."""
    parser = argparse.ArgumentParser(prog="lmserve", description="lmserve: an LLM serving engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_chat(commands)
    _add_serve(commands)
    _add_plan(commands)
    _add_compile(commands)
    add_bench_parser(commands)  # lmserve.bench owns its flags
    from lmserve.train.command import add_train_heads_parser  # it builds on this module

    add_train_heads_parser(commands)  # lmserve.train owns its flags too
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``lmserve`` command line; returns the process exit status."""
    args = build_parser().parse_args(argv)
    from lmserve.kernels.build import selected_isa

    try:
        selected_isa()  # LMSERVE_ISA, checked before anything loads
    except ValueError as err:
        args.parser.error(str(err))
    return args.handler(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
