"""``lmserve compile``: write a model library (see ``library.py`` for its layout).

Everything the engine does to a model before its first step, done once: the weights read and
prepared for the chosen level (packed blocks, bf16 casts, dequantized embeddings), split into
each rank's shard and stage; the kernels built for this CPU; the tokenizer converted. A library
is written to a temporary directory beside ``output`` and renamed into place, so a failed or
interrupted compile leaves nothing that looks like a library.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import lmserve
from lmserve.config import EngineConfig, opt_without_draft_opt, parse_opt
from lmserve.kernels.build import build_kernel, kernel_names, native_isa
from lmserve.library.library import FORMAT, INFO_FILE, TREE_KEY, LibraryInfo, file_sha256, package_digest
from lmserve.library.tensors import write_tensors
from lmserve.library.tree import to_tree
from lmserve.models.loader import model_fingerprint
from lmserve.models.source import ModelFiles, use_kernels_of
from lmserve.parallel.rank import rank_part
from lmserve.parallel.stages import stage_layers


def compile_library(config: EngineConfig, output: str,
                    log: Callable[[str], None] = lambda line: None) -> LibraryInfo:
    """Compile the model of ``config`` at its opt level and parallel split into a library at
    ``output`` (which must not exist yet); ``log`` gets a line per stage of the work."""
    if config.model_lib is not None:
        raise ValueError(f"model_lib={config.model_lib!r}: compile writes a library from a model "
                         f"(--model), it does not read one")
    out = Path(output).expanduser().absolute()
    if out.exists():
        raise FileExistsError(f"--output {output} exists; remove it or choose another directory")
    opt_text = opt_without_draft_opt(config.opt)  # (the draft's level is the serving config's)
    opt = parse_opt(opt_text)
    if opt.compile:
        raise ValueError(f"opt={config.opt!r}: compile=1 builds torch.compile graphs when the model "
                         f"loads, which a library cannot hold; compile a level without it")
    use_kernels_of(config)  # this process builds its kernels (a library opened before had its own)
    model_files = ModelFiles(config.model)
    path, args = model_files.path, model_files.args
    tensor, stages = config.tensor_parallel_shards or 1, config.pipeline_parallel_stages or 1
    layers_of_stages = stage_layers(args, stages, tensor) if stages > 1 else ()
    ranks = tensor * stages
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # (mkdtemp makes it private)
    try:
        (tmp / "kernels").mkdir()
        built = []
        for name in kernel_names():
            shared_object = build_kernel(name)
            if shared_object is not None:
                shutil.copyfile(shared_object, tmp / "kernels" / f"{name}.so")
                built.append(name)
        log(f"kernels: {', '.join(built) or 'none (the torch path)'}")
        for rank in range(ranks):
            shard, layers = rank_part(rank, tensor, layers_of_stages)
            model = model_files.load_model(opt, rank, shard, layers, head=rank == 0)
            tree, tensors = to_tree(model)
            write_tensors(str(tmp / f"rank-{rank}.safetensors"), tensors, {TREE_KEY: json.dumps(tree)})
            log(f"rank {rank}: {len(tensors)} tensors, "
                f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.1f} MiB")
            del model, tensors
        model_files.tokenizer().save_pretrained(str(tmp / "tokenizer"))
        defaults = model_files.generation_defaults()
        files = {str(f.relative_to(tmp)): {"sha256": file_sha256(f), "size": f.stat().st_size}
                 for f in sorted(tmp.rglob("*")) if f.is_file()}
        info = LibraryInfo(
            format=FORMAT, lmserve=lmserve.__version__, code=package_digest(),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=compile_command(config, path, str(out)),
            model={"name": Path(path.rstrip("/")).name, "path": path, "sha256": model_sha256(path),
                   "fingerprint": model_fingerprint(path)},
            opt=opt_text, tensor_parallel_shards=config.tensor_parallel_shards,
            pipeline_parallel_stages=config.pipeline_parallel_stages,
            stage_layers=[[r.start, r.stop] for r in layers_of_stages],
            args=to_tree(args)[0], generation_defaults=asdict(defaults),
            isa=native_isa() if built else [], files=files)
        (tmp / INFO_FILE).write_text(json.dumps(asdict(info), indent=1) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def compile_command(config: EngineConfig, model_path: str, output: str) -> str:
    """The ``lmserve compile`` command line that writes this library again."""
    words = ["lmserve", "compile", "--model", model_path]
    partition = os.environ.get("LMSERVE_PP_LAYER_PARTITION")
    if config.pipeline_parallel_stages and partition:  # the stages' layers, set by hand
        words.insert(0, f"LMSERVE_PP_LAYER_PARTITION={partition}")
    values = {"opt": opt_without_draft_opt(config.opt), "tensor_parallel_shards": config.tensor_parallel_shards,
              "pipeline_parallel_stages": config.pipeline_parallel_stages}
    for name, value in values.items():
        if value is not None:
            words += ["--" + name.replace("_", "-"), str(value)]
    return shlex.join(words + ["--output", output])


def model_sha256(path: str) -> str:
    """sha256 of a model file, or of a directory's files (each name and sha256, in order)."""
    if Path(path).is_file():
        return file_sha256(Path(path))
    digest = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            digest.update(f"{f.name}:{file_sha256(f)};".encode())
    return digest.hexdigest()
