"""The synchronous Python API: ``Engine`` with ``chat.completions.create`` and ``completions.create``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import uuid
from typing import Generator, Optional

from lmserve.config import EngineConfig
from lmserve.engine.core import EngineCore
from lmserve.engine.loop import EngineLoop
from lmserve.frontend.openai.facades import Chat, Completions
from lmserve.generation_defaults import check_generation_config
from lmserve.outputs import EngineStats, RequestOutput
from lmserve.sampling_params import SamplingParams

_ids = itertools.count()


def make_config(model: Optional[str], config: Optional[EngineConfig], overrides: dict) -> EngineConfig:
    """One EngineConfig from the three ways a caller can give one (overrides win)."""
    base = config or EngineConfig()
    changes = dict(overrides)
    if model is not None:
        changes["model"] = model
    unknown = set(changes) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return dataclasses.replace(base, **changes)


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}-{next(_ids)}"


class EngineBase:
    """What the sync and async engines share: loading, the engine thread, and the tokenizer."""

    def __init__(self, model: Optional[str] = None, *, config: Optional[EngineConfig] = None,
                 generation_config: str = "auto", **overrides) -> None:
        """``generation_config``: ``"auto"`` fills the sampling fields a chat or completion request
        leaves unset with the model's defaults (``generation_config.json``, or llama.cpp's for
        a GGUF file); ``"none"`` leaves OpenAI's (see ``lmserve.generation_defaults``)."""
        self.config = make_config(model, config, overrides)
        check_generation_config(generation_config)
        if self.config.verbose and not logging.getLogger("lmserve").handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s lmserve: %(message)s"))
            logging.getLogger("lmserve").addHandler(handler)
            logging.getLogger("lmserve").setLevel(logging.INFO)
        self._loop = EngineLoop(lambda: EngineCore(self.config))
        self._core = self._loop.core
        self.config = self._core.config  # with a model library's opt and parallel split
        try:
            self.generation_defaults = self._core.source.generation_defaults(generation_config)
        except BaseException:  # a bad generation_config.json: the engine stops again
            self._loop.shutdown()
            raise
        if self.config.verbose:
            logging.getLogger("lmserve").info("%s", self.generation_defaults.describe())
        self.tokenizer = self._core.tokenizer
        self.model_name = self._core.source.name
        self.max_model_len = self._core.plan.max_single_sequence_length

    @property
    def plan(self):
        return self._core.plan

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for a request the engine would refuse (from any thread)."""
        self._core.validate(prompt_token_ids, params)

    def stats(self) -> EngineStats:
        """Running and waiting requests, KV pages in use, preemptions, token counters."""
        return self._loop.call(self._core.stats)

    def kv_pages_in_use(self) -> int:
        """KV pages held by requests (0 once every request is finished or aborted; pages kept
        only by the prefix cache do not count)."""
        return self._loop.call(self._core.pages_held_by_requests)

    def state_slots_in_use(self) -> int:
        """Recurrent-state slots held by requests (a model with recurrent layers; 0 once every
        request is finished or aborted; prefix-cache snapshots do not count)."""
        return self._loop.call(self._core.state_slots_held_by_requests)

    @property
    def failure(self) -> Optional[BaseException]:
        """What stopped the engine for good (a parallel engine that lost a rank), or None."""
        return self._loop.failure

    def is_idle(self) -> bool:
        """True when no request is queued, running or waiting for its abort to be processed."""
        return self._loop.is_idle()

    def shutdown(self) -> None:
        """Stop the engine thread; requests still running end with an error."""
        self._loop.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class Engine(EngineBase):
    """Loads a model and serves requests from any number of threads through one engine thread.

    ``Engine()`` serves the built-in model; ``Engine("model.gguf")`` or ``Engine("hf_dir/")``
    another one; any :class:`EngineConfig` field can be given as a keyword.
    """

    def __init__(self, model: Optional[str] = None, *, config: Optional[EngineConfig] = None,
                 generation_config: str = "auto", **overrides) -> None:
        super().__init__(model, config=config, generation_config=generation_config, **overrides)
        self.chat = Chat(self)
        self.completions = Completions(self)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: Optional[str] = None) -> Generator[RequestOutput, None, None]:
        """Stream a request's outputs; stopping the iteration early aborts the request."""
        request_id = request_id or new_request_id()
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._loop.submit(request_id, prompt_token_ids, params, outputs.put)
        finished = False
        try:
            while not finished:
                out = outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._loop.abort(request_id)
