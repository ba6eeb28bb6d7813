"""``lmserve train-heads``: EAGLE or Medusa heads for any model the engine serves, on a CPU.

The model answers a set of prompts (the built-in varied set, or ``--prompts FILE``); its hidden
states along those answers are recorded; the heads learn to predict them (``fit``); they are
written in the layout people publish (EAGLE-1: ``config.json`` + ``model.safetensors``; Medusa:
FasterDecoding's ``config.json`` + ``medusa_lm_head.safetensors``), so they load here and in
other engines, with the answers' tokens as their draft vocabulary (``draft_vocab.json``); and the engine then
measures their acceptance on held-out prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from typing import Any, Union

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from lmserve.engine.core import EngineCore
from lmserve.engine_args import add_engine_args, engine_config_from_args
from lmserve.models.loader import load_weights
from lmserve.models.source import ModelFiles
from lmserve.outputs import EngineStats
from lmserve.speculative.draft_vocab import write_draft_vocab
from lmserve.speculative.head_nets import EagleNet, MedusaNet
from lmserve.train.data import Sample, features, generate
from lmserve.train.fit import FitSettings, answer_vocabulary, fit_eagle, fit_medusa
from lmserve.train.prompts import builtin_prompts, read_prompts


def add_train_heads_parser(subparsers: Any) -> None:
    """Add the ``train-heads`` subcommand (sets ``handler`` and ``parser`` like the others)."""
    p = subparsers.add_parser(
        "train-heads", help="train EAGLE or Medusa draft heads for a model, on this machine",
        description="Train speculative-decoding heads for the model from its own answers "
                    "(self-distillation) and write them in the published layouts, ready for "
                    "--speculative-mode eagle|medusa --additional-models DIR.")
    p.add_argument("--kind", choices=("eagle", "medusa"), required=True,
                   help="eagle: an EAGLE-1 head (one decoder layer); medusa: Medusa heads")
    p.add_argument("--out", required=True, help="directory to write the heads to")
    p.add_argument("--prompts", help="a file of prompts, one per line (or .jsonl: strings or "
                   "{\"prompt\": ...}); default: the built-in set of 328 varied prompts")
    p.add_argument("--num-prompts", type=int,
                   help="prompts to train on (default: all but the held-out ones; more data, "
                        "higher acceptance)")
    p.add_argument("--held-out", type=int, default=16,
                   help="further prompts the acceptance is measured on at the end (default 16; 0: skip)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length (default 256)")
    p.add_argument("--answers", type=int, default=1,
                   help="answers per training prompt: the greedy one, then sampled ones "
                        "(more data from the same prompts; default 1)")
    p.add_argument("--epochs", type=int, default=FitSettings.epochs)
    p.add_argument("--lr", type=float, default=FitSettings.lr)
    p.add_argument("--batch", type=int, default=FitSettings.batch, help="conversations per step")
    p.add_argument("--draft-passes", type=int, default=FitSettings.draft_passes,
                   help="eagle: draft passes trained per position, each from the head's own "
                        "prediction before it (EAGLE-3's training-time test; 1: teacher forced "
                        f"only; default {FitSettings.draft_passes})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--medusa-heads", type=int, default=4)
    p.add_argument("--medusa-layers", type=int, default=1)
    p.add_argument("--draft-length", type=int, default=0,
                   help="draft length of the acceptance check (default: 4, or Medusa's heads)")
    # Many prompts at once: the engine's server mode batches them.
    add_engine_args(p, defaults={"mode": "server", "verbose": False})
    p.set_defaults(handler=run, parser=p)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Generate, record, train, write, measure; returns the exit status."""
    try:
        config = engine_config_from_args(args)
        if config.model_lib is not None:
            raise ValueError("argument --model-lib: train-heads reads the model's own weights; "
                             "give the model with --model")
        if config.speculative_mode != "disable":
            raise ValueError("argument --speculative-mode: train-heads runs the model without "
                             "speculation; the heads it writes are for --speculative-mode later")
        prompts = read_prompts(args.prompts) if args.prompts else builtin_prompts()
        if args.num_prompts is None:
            args.num_prompts = len(prompts) - args.held_out
        for name in ("num_prompts", "max_tokens", "answers", "epochs", "batch", "draft_passes",
                     "medusa_heads", "medusa_layers"):
            if getattr(args, name) < 1:
                raise ValueError(f"argument --{name.replace('_', '-')}: must be at least 1")
        if args.held_out < 0 or args.num_prompts + args.held_out > len(prompts):
            raise ValueError(f"--num-prompts {args.num_prompts} and --held-out {args.held_out} ask "
                             f"for more than the {len(prompts)} prompts there are")
    except (OSError, ValueError) as err:
        parser.error(str(err))
    train, held_out = split_prompts(prompts, args.num_prompts, args.held_out, args.seed)
    settings = FitSettings(epochs=args.epochs, lr=args.lr, batch=args.batch,
                           draft_passes=args.draft_passes, seed=args.seed)
    started = time.perf_counter()

    core = EngineCore(config)
    source = core.source
    assert isinstance(source, ModelFiles)  # not a model library: refused above
    _log(f"{args.kind} heads for {source.path} at opt {config.opt or 'default'}: {len(train)} prompts, "
         f"{args.answers} answer{'s' if args.answers > 1 else ''} each of up to {args.max_tokens} tokens")
    with tqdm(total=len(train) * args.answers * args.max_tokens, unit="tok", desc="answering",
              file=sys.stderr) as bar:
        samples = generate(core, train, args.max_tokens, bar.update, args.answers)
    if core.prefix_cache is not None:
        core.prefix_cache.clear()  # the feature pass borrows the pool's pages
    with tqdm(total=sum(len(s.tokens) for s in samples), unit="tok", desc="hidden states",
              file=sys.stderr) as bar:
        features(core, samples, (), bar.update)
    head, embed = _head_and_embedding(core)
    args_of_model, model_path = core.args, source.path
    del core

    bar = tqdm(total=settings.epochs * sum(len(s.tokens) for s in samples), unit="tok",
               desc="training", file=sys.stderr)

    def progress(tokens: int, loss: float, accuracy: float) -> None:
        bar.set_postfix(loss=f"{loss:.3f}", top1=f"{accuracy:.2f}", refresh=False)
        bar.update(tokens)

    net: Union[EagleNet, MedusaNet]
    with bar:
        if args.kind == "eagle":
            net = fit_eagle(samples, head, embed, args_of_model, settings, progress)
        else:
            net = fit_medusa(samples, head, args.medusa_heads, args.medusa_layers, settings, progress)
    os.makedirs(args.out, exist_ok=True)
    if isinstance(net, EagleNet):
        write_eagle(net, args_of_model, args.out)
    else:
        write_medusa(net, model_path, args.out)
    write_draft_vocab(args.out, answer_vocabulary(samples))
    _log(f"wrote {args.kind} heads to {args.out} ({time.perf_counter() - started:.0f} s)")

    if held_out:
        k = args.draft_length or (args.medusa_heads if args.kind == "medusa" else 4)
        spec = dataclasses.replace(config, speculative_mode=args.kind, spec_draft_length=k,
                                   additional_models=[args.out])
        stats, _ = measure_acceptance(spec, held_out, args.max_tokens)
        _log(f"held-out acceptance on {len(held_out)} prompts, at most {k} drafts a step: "
             f"{acceptance_length(stats):.2f} tokens per step, "
             f"{stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1):.1%} of drafts accepted")
    return 0


def split_prompts(prompts: list[str], num_train: int, num_held_out: int, seed: int
                  ) -> tuple[list[str], list[str]]:
    """The prompts to train on and the held-out ones, drawn apart at random by ``seed``. The
    held-out ones are the same whatever ``num_train`` is, so that runs on more or less data
    are measured alike."""
    shuffled = list(prompts)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:num_train], shuffled[len(shuffled) - num_held_out:] if num_held_out else []


def measure_acceptance(config, prompts: list[str], max_tokens: int
                       ) -> tuple[EngineStats, list[Sample]]:
    """The engine's speculation counters after answering ``prompts`` under ``config``, and the
    answers."""
    core = EngineCore(config)
    with tqdm(total=len(prompts) * max_tokens, unit="tok", desc="held-out", file=sys.stderr) as bar:
        samples = generate(core, prompts, max_tokens, bar.update)
    return core.stats(), samples


def acceptance_length(stats: EngineStats) -> float:
    """Tokens a verify step yields on average (accepted drafts plus the model's own)."""
    return 1 + stats.spec_num_accepted_tokens / max(stats.spec_num_drafts, 1)


def write_eagle(net: EagleNet, target, out: str) -> None:
    """SafeAILab's EAGLE-1 layout: a one-layer Llama ``config.json`` and ``model.safetensors``."""
    a = net.args
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True,
              "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
              "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
              "head_dim": a.head_dim, "num_hidden_layers": 1, "rms_norm_eps": a.rms_norm_eps,
              "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
              "max_position_embeddings": target.context_length, "vocab_size": target.vocab_size,
              "hidden_act": "silu", "torch_dtype": "float32"}
    _write(out, config, "model.safetensors", net.state_dict())


def write_medusa(net: MedusaNet, model_path: str, out: str) -> None:
    """FasterDecoding's layout: ``config.json`` and ``medusa_lm_head.safetensors``."""
    config = {"medusa_num_heads": net.num_heads, "medusa_num_layers": net.num_layers,
              "base_model_name_or_path": model_path}
    _write(out, config, "medusa_lm_head.safetensors", net.state_dict())


def _write(out: str, config: dict, name: str, state: dict[str, torch.Tensor]) -> None:
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file({n: t.detach().contiguous() for n, t in state.items()}, os.path.join(out, name))


def _head_and_embedding(core: EngineCore) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's head and token embeddings ``(V, D)`` in float32, from its file."""
    source = core.source
    assert isinstance(source, ModelFiles)  # train-heads refuses a model library
    weights = load_weights(source.path)
    embed = weights["model.embed_tokens.weight"].float()
    head = weights.get("lm_head.weight")
    head = embed if head is None or core.args.tie_word_embeddings else head.float()
    return head, embed


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
