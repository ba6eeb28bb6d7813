"""A model library: a directory holding everything the engine otherwise prepares when it loads
a model, written by ``lmserve compile`` (``lmserve.library.compile``) and served with
``EngineConfig(model_lib=DIR)``.

    lmserve-library.json   what it holds and for what: lmserve version and source digest, the
                           model (name, sha256, fingerprint), opt, tensor/pipeline split, the
                           instruction sets its kernels need, the sha256 of every other file
    rank-<r>.safetensors   rank r's part of the model, built (packed blocks, bf16 casts, its
                           shard and stage), with its object tree in the metadata
    kernels/<name>.so      the C++ kernels, built for the CPU it was compiled on
    tokenizer/             the tokenizer and chat template in Hugging Face form

Opening a library checks it against this install and this CPU and refuses, saying what differs
and how to rebuild, rather than run code built for something else or fall back silently.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lmserve
from lmserve.config import EngineConfig, OptFlags, opt_without_draft_opt, parse_opt
from lmserve.generation_defaults import GenerationDefaults, check_generation_config
from lmserve.kernels.build import cache_dir, cpu_flags
from lmserve.library.tensors import read_tensors
from lmserve.library.tree import from_tree
from lmserve.models.args import ModelArgs
from lmserve.models.llama import LlamaModel
from lmserve.models.loader import model_fingerprint, resolve_model_path
from lmserve.parallel.shard import TensorShard
from lmserve.tokenizer import Tokenizer

logger = logging.getLogger("lmserve")

INFO_FILE = "lmserve-library.json"
FORMAT = 1  # the layout above; a library of another format is refused
TREE_KEY = "lmserve.model"  # the object tree's key in a rank file's safetensors metadata
_PACKAGE_DIR = Path(lmserve.__file__).parent


class LibraryError(ValueError):
    """A model library that cannot be served here; the message says why and how to rebuild."""


@functools.cache
def package_digest() -> str:
    """A digest of this lmserve's code (its Python and C++ sources): a library holds objects
    and kernels of exactly the code that wrote it."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(_PACKAGE_DIR)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified_stamp(path: Path, sha256: str) -> Path:
    """Where the cache notes that ``path``, as it is now, has ``sha256``: a file's identity
    (device, inode) and its size, modification and change times (the last one no user can set)
    change with any write or copy, so a later start maps the file without reading it first."""
    st = path.stat()
    key = f"{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{sha256}"
    return cache_dir().parent / "verified" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _write_stamp(stamp: Path) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError:  # a read-only cache: hash again next time
        pass


@dataclass
class LibraryInfo:
    """The contents of ``lmserve-library.json``."""

    format: int
    lmserve: str  # version
    code: str  # package_digest() of the lmserve that compiled it
    created: str  # ISO 8601, UTC
    command: str  # the command that compiled it (given back in refusals, to rebuild)
    model: dict[str, Any]  # name, path, sha256, fingerprint
    opt: Optional[str]
    tensor_parallel_shards: Optional[int]
    pipeline_parallel_stages: Optional[int]
    stage_layers: list[list[int]]  # each pipeline stage's [first, end) layers (none: one stage)
    args: Any  # the model's ModelArgs, as lmserve.library.tree writes it
    generation_defaults: dict[str, Any]  # GenerationDefaults' values and source
    isa: list[str]  # the instruction sets (Linux's names) the kernels may execute
    files: dict[str, dict[str, Any]]  # relative path -> sha256, size

    @property
    def ranks(self) -> int:
        return (self.tensor_parallel_shards or 1) * (self.pipeline_parallel_stages or 1)


def library_fingerprint(directory: str) -> str:
    """A digest naming a library's contents (its info file lists every file's sha256)."""
    return hashlib.sha256((Path(directory).expanduser() / INFO_FILE).read_bytes()).hexdigest()[:16]


class ModelLibrary:
    """An opened model library: checked against this lmserve and this CPU (``open``), it gives
    the engine its config, model, tokenizer and sampling defaults without preparing anything."""

    def __init__(self, root: Path, info: LibraryInfo) -> None:
        self.root = root
        self.info = info
        self.args: ModelArgs = from_tree(info.args, {})
        self._verified: set[str] = set()

    @classmethod
    def open(cls, directory: str, model: Optional[str] = None) -> ModelLibrary:
        """Open the library at ``directory`` and check it: format, lmserve code, this CPU's
        instruction sets, ``model`` (when given, it must be the model compiled), and the
        kernel and tokenizer files' hashes (a rank's weights are checked when it loads them).
        Raises ``LibraryError`` naming what does not fit."""
        root = Path(directory).expanduser().absolute()
        path = root / INFO_FILE
        if not path.is_file():
            raise LibraryError(f"model_lib {directory!r} is not a model library: it has no {INFO_FILE} "
                               f"(write one with: lmserve compile --output {directory})")
        try:
            raw = json.loads(path.read_text())
            command = raw.get("command", "lmserve compile ...")
        except (json.JSONDecodeError, AttributeError) as err:
            raise LibraryError(f"model library {root}: {INFO_FILE} is damaged ({err})") from None
        # What wrote it first: another lmserve may have written other fields.
        if raw.get("format") != FORMAT:
            raise LibraryError(f"model library {root} has format {raw.get('format')!r}; this lmserve "
                               f"reads format {FORMAT}; rebuild it with: {command}")
        if (raw.get("lmserve"), raw.get("code")) != (lmserve.__version__, package_digest()):
            raise LibraryError(f"model library {root} was compiled by lmserve {raw.get('lmserve')} "
                               f"(code {raw.get('code')}), and this is lmserve {lmserve.__version__} "
                               f"(code {package_digest()}); rebuild it with: {command}")
        try:
            library = cls(root, LibraryInfo(**raw))
        except (TypeError, ValueError, KeyError) as err:
            raise LibraryError(f"model library {root}: {INFO_FILE} is damaged ({err})") from None
        library._check(model)
        return library

    def _refuse(self, why: str) -> LibraryError:
        return LibraryError(f"model library {self.root} {why}; rebuild it with: {self.info.command}")

    def _check(self, model: Optional[str]) -> None:
        info = self.info
        missing = sorted(set(info.isa) - cpu_flags())
        if missing:
            raise self._refuse(f"was compiled for a CPU with instruction sets this CPU lacks: "
                               f"{', '.join(missing)}")
        if model is not None:
            path = resolve_model_path(model)
            if model_fingerprint(path) != info.model["fingerprint"]:
                raise self._refuse(f"was compiled from {info.model['path']}, and model={model!r} "
                                   f"is another model (its files differ); leave model unset to "
                                   f"serve the library's")
        for name in info.files:
            if not name.startswith("rank-"):
                self.verify(name)

    def verify(self, name: str) -> Path:
        """The path of the library's file ``name``, once its size and sha256 are checked."""
        path = self.root / name
        if name not in self._verified:
            expected = self.info.files[name]
            if not path.is_file():
                raise self._refuse(f"lacks its file {name}")
            size = path.stat().st_size
            if size != expected["size"]:
                raise self._refuse(f"is damaged: {name} has {size} bytes, {expected['size']} were written")
            stamp = _verified_stamp(path, expected["sha256"])
            if not stamp.exists():
                if file_sha256(path) != expected["sha256"]:
                    raise self._refuse(f"is damaged: {name} does not have the sha256 it was written with")
                _write_stamp(stamp)
            self._verified.add(name)
        return path

    def apply(self, config: EngineConfig) -> EngineConfig:
        """``config`` with the library's opt, tensor_parallel_shards and pipeline_parallel_stages
        (a different value given is logged as ignored, as MLC LLM does); the draft_opt knob is
        the drafter's (a draft model's or heads'), and kept."""
        info = self.info
        given = opt_without_draft_opt(config.opt)
        if given is not None and parse_opt(given) != parse_opt(info.opt):
            logger.warning("opt=%r is ignored: the model library %s was compiled with opt=%r",
                           config.opt, self.root, info.opt)
        for name in ("tensor_parallel_shards", "pipeline_parallel_stages"):
            value = getattr(config, name)
            if value is not None and value != (getattr(info, name) or 1):
                logger.warning("%s=%d is ignored: the model library %s was compiled with %s=%s",
                               name, value, self.root, name, getattr(info, name) or 1)
        opt = info.opt
        draft = parse_opt(config.opt).draft_opt
        if draft is not None:
            opt = ";".join(filter(None, (info.opt, f"draft_opt={draft}")))
        return dataclasses.replace(config, opt=opt, tensor_parallel_shards=info.tensor_parallel_shards,
                                   pipeline_parallel_stages=info.pipeline_parallel_stages)

    @property
    def name(self) -> str:
        """The compiled model's name (its file's or directory's)."""
        return self.info.model["name"]

    @property
    def stage_layers(self) -> tuple[range, ...]:
        return tuple(range(a, b) for a, b in self.info.stage_layers)

    def load_model(self, opt: OptFlags, rank: int = 0, shard: Optional[TensorShard] = None,
                   layers: Optional[range] = None, head: bool = True) -> LlamaModel:
        """Rank ``rank``'s part of the model, its tensors mapped from its file (not copied).
        (``opt``, ``shard``, ``layers`` and ``head`` are the library's, applied when compiled.)"""
        if not 0 <= rank < self.info.ranks:
            raise self._refuse(f"holds {self.info.ranks} ranks' parts, not rank {rank}'s")
        name = f"rank-{rank}.safetensors"
        path = self.verify(name)
        try:
            tensors, metadata = read_tensors(str(path))
            return from_tree(json.loads(metadata[TREE_KEY]), tensors)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise self._refuse(f"is damaged: {name} does not hold a model lmserve reads ({err})") from None

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_pretrained_dir(str(self.root / "tokenizer"))

    def generation_defaults(self, mode: str = "auto") -> GenerationDefaults:
        """The compiled model's sampling defaults (``mode`` as ``read_generation_defaults``)."""
        check_generation_config(mode)
        if mode == "none":
            return GenerationDefaults()
        return GenerationDefaults(**self.info.generation_defaults)

    def describe(self) -> str:
        info = self.info
        return (f"model library {self.root}: {self.name} at opt {info.opt or 'default'}, "
                f"{info.ranks} rank(s), compiled {info.created}")
