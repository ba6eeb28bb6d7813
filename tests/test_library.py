"""Model libraries (``lmserve compile``, ``EngineConfig(model_lib=DIR)``): outputs identical to the
JIT path at every level and with tensor and pipeline parallelism, each refusal with its message,
weights memory-mapped and no compiler run when loading, a draft model from a library."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import safetensors
import torch

from lmserve import Engine, EngineConfig, SamplingParams
from lmserve.kernels.build import selected_isa
from lmserve.library.compile import compile_library
from lmserve.library.library import INFO_FILE, LibraryError, ModelLibrary
from lmserve.library.tensors import read_tensors, write_tensors
from lmserve.library.tree import from_tree, to_tree
from lmserve.models.builtin import builtin_model_path
from lmserve.tokenizer import Tokenizer
from server_process import ServerProcess
from tiny_models import make_gguf_llama, make_hf_llama, make_hf_recurrent

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 18, 19, 20, 21, 22, 23, 24, 25, 26],
           [1, 1213, 1155, 2213, 288, 253, 5347, 30]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=2)


def outputs(engine: Engine, prompts=PROMPTS, params=GREEDY) -> list[tuple]:
    """Each prompt's tokens and logprobs (top ones included), one prompt after another."""
    streams = [engine.generate(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    result = []
    for stream in streams:
        deltas = [d for out in stream for d in out.deltas]
        result.append((sum((d.token_ids for d in deltas), []),
                       [(lp.token_id, lp.logprob, lp.top) for d in deltas for lp in d.logprobs]))
    return result


@pytest.fixture(scope="module")
def library_dir(tmp_path_factory):
    """The built-in model compiled at the default level (O2)."""
    path = str(tmp_path_factory.mktemp("lib") / "o2")
    compile_library(EngineConfig(), path)
    return path


def copy_library(src: str, dst) -> str:
    subprocess.run(["cp", "-r", src, str(dst)], check=True)
    return str(dst)


# -- the same outputs as the JIT path -----------------------------------------------------------

def test_default_level_library_equals_jit(builtin_engine, library_dir):
    """opt="O0" is ignored: the library runs its own level (O2), exactly as the JIT path does."""
    engine = Engine(model_lib=library_dir, opt="O0", max_num_sequence=8, max_total_sequence_length=8192,
                    verbose=False)
    try:
        assert outputs(engine) == outputs(builtin_engine)
        assert engine.model_name == os.path.basename(builtin_model_path())
        assert engine.config.opt is None  # the library's (the default level)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("opt", ["O0", "O1", "O3"])
def test_every_level_library_equals_jit(tmp_path, opt):
    lib = str(tmp_path / "lib")
    compile_library(EngineConfig(opt=opt), lib)
    jit = Engine(opt=opt, verbose=False)
    try:
        expected = outputs(jit)
    finally:
        jit.shutdown()
    engine = Engine(model_lib=lib, verbose=False)
    try:
        assert engine.config.opt == opt
        assert outputs(engine) == expected
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch, opt", [("llama", "O0"), ("mamba2", "O0"), ("mamba2", "O2")])
def test_tiny_models_library_equals_jit(tmp_path, tiny_model_dir, arch, opt):
    """Dense float32 weights and a recurrent model's mixers (torch and C++ paths) go through a
    library too."""
    model = tiny_model_dir if arch == "llama" else make_hf_recurrent(str(tmp_path / "m"), arch, seed=2)
    lib = str(tmp_path / "lib")
    compile_library(EngineConfig(model=model, opt=opt), lib)
    engines = [Engine(model=model, opt=opt, verbose=False), Engine(model_lib=lib, verbose=False)]
    try:
        jit, library = (outputs(e) for e in engines)
        assert library == jit
    finally:
        for e in engines:
            e.shutdown()


def test_library_tokenizer_is_the_models(library_dir):
    jit, lib = Tokenizer.from_model(None), ModelLibrary.open(library_dir).tokenizer()
    text = "Grüße, 世界! <|im_end|> 12345"
    assert lib.encode(text) == jit.encode(text)
    assert lib.decode(jit.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert lib.render_chat(chat) == jit.render_chat(chat)
    assert (lib.eos_token_ids, lib.bos_token_id, lib.vocab_size) == \
        (jit.eos_token_ids, jit.bos_token_id, jit.vocab_size)


# -- config from the library ----------------------------------------------------------------------

def test_opt_and_split_come_from_the_library(library_dir, caplog):
    library = ModelLibrary.open(library_dir)
    with caplog.at_level(logging.WARNING, logger="lmserve"):
        config = library.apply(EngineConfig(model_lib=library_dir, opt="O0;draft_opt=O1",
                                            tensor_parallel_shards=2, max_num_sequence=3,
                                            speculative_mode="small_draft", additional_models=["d"]))
    assert (config.opt, config.tensor_parallel_shards, config.max_num_sequence) == \
        ("draft_opt=O1", None, 3)  # the draft's level stays the user's
    assert "opt='O0;draft_opt=O1' is ignored" in caplog.text
    assert "tensor_parallel_shards=2 is ignored" in caplog.text
    caplog.clear()
    library.apply(EngineConfig(model_lib=library_dir, opt="O2"))  # the same level: not logged
    library.apply(EngineConfig(model_lib=library_dir, opt="draft_opt=O0", speculative_mode="small_draft",
                               additional_models=["d"]))  # the draft's level only: not logged
    assert caplog.text == ""


# -- refusals -------------------------------------------------------------------------------------

def edit_info(lib: str, **changes) -> None:
    path = os.path.join(lib, INFO_FILE)
    with open(path) as f:
        info = json.load(f)
    info.update(changes)
    with open(path, "w") as f:
        json.dump(info, f)


def refusal(lib: str, model=None) -> str:
    with pytest.raises(LibraryError) as err:
        Engine(model_lib=lib, model=model, verbose=False)
    return str(err.value)


def test_a_directory_that_is_not_a_library_is_refused(tmp_path):
    assert "is not a model library: it has no lmserve-library.json" in refusal(str(tmp_path))


def test_another_lmserve_version_or_code_is_refused(tmp_path, library_dir):
    lib = copy_library(library_dir, tmp_path / "old")
    edit_info(lib, lmserve="0.0.9")
    message = refusal(lib)
    assert "was compiled by lmserve 0.0.9" in message and "rebuild it with: lmserve compile" in message
    lib = copy_library(library_dir, tmp_path / "edited")
    args = ModelLibrary.open(library_dir).info.args
    args["fields"]["a_field_from_another_version"] = 1  # what the other code wrote: never read
    edit_info(lib, code="0123456789abcdef", args=args, another_field=2)
    assert "(code 0123456789abcdef)" in refusal(lib)
    edit_info(lib, format=2)
    assert "has format 2; this lmserve reads format 1" in refusal(lib)


def test_a_library_for_another_cpu_is_refused(tmp_path, library_dir, monkeypatch):
    info = ModelLibrary.open(library_dir).info
    assert set(selected_isa().needs) <= set(info.isa)  # what the kernels were built for here
    lacking = max(info.isa)
    monkeypatch.setattr("lmserve.library.library.cpu_flags", lambda: set(info.isa) - {lacking})
    assert f"compiled for a CPU with instruction sets this CPU lacks: {lacking}" in refusal(library_dir)


def test_a_library_of_another_model_is_refused(library_dir, tiny_model_dir):
    assert "is another model (its files differ)" in refusal(library_dir, model=tiny_model_dir)
    engine_args = ModelLibrary.open(library_dir, model=builtin_model_path()).args  # the same: fine
    assert engine_args.num_layers == 30


def test_a_damaged_library_is_refused(tmp_path, library_dir):
    lib = copy_library(library_dir, tmp_path / "truncated")
    weights = os.path.join(lib, "rank-0.safetensors")
    size = os.path.getsize(weights)
    os.truncate(weights, size - 4096)
    assert f"is damaged: rank-0.safetensors has {size - 4096} bytes, {size} were written" in refusal(lib)
    lib = copy_library(library_dir, tmp_path / "flipped")
    with open(os.path.join(lib, "rank-0.safetensors"), "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 1]))
    assert "rank-0.safetensors does not have the sha256 it was written with" in refusal(lib)
    lib = copy_library(library_dir, tmp_path / "no-kernel")
    os.remove(os.path.join(lib, "kernels", "int8_gemm.so"))
    assert "lacks its file kernels/int8_gemm.so" in refusal(lib)


def test_compile_refuses_an_existing_output_and_a_library_as_input(tmp_path, library_dir):
    with pytest.raises(FileExistsError, match="exists; remove it"):
        compile_library(EngineConfig(), library_dir)
    with pytest.raises(ValueError, match="does not read one"):
        compile_library(EngineConfig(model_lib=library_dir), str(tmp_path / "x"))
    assert os.listdir(tmp_path) == []  # nothing half-written


# -- loading: memory-mapped, no compiler ----------------------------------------------------------

_LOAD_SCRIPT = textwrap.dedent("""
    import json, os, struct, sys
    from lmserve import Engine, SamplingParams
    from lmserve.library.tree import to_tree
    from lmserve.util import cdiv
    engine = Engine(model_lib=sys.argv[1], verbose=False)
    out = [[d for o in engine.generate(p, SamplingParams(max_tokens=8, temperature=0, logprobs=0))
            for d in o.deltas] for p in json.loads(sys.argv[2])]
    greedy = [[sum((d.token_ids for d in ds), []), [lp.logprob for d in ds for lp in d.logprobs]]
              for ds in out]
    _, tensors = to_tree(engine._core.runner.model)
    maps, kernels = [], set()  # the weights file's address ranges; the kernels' files
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[-1].endswith("rank-0.safetensors"):
            maps.append(tuple(int(x, 16) for x in fields[0].split("-")))
        if len(fields) >= 6 and fields[-1].endswith(".so") and "/kernels/" in fields[-1]:
            kernels.add(fields[-1])
    copied = [n for n, t in tensors.items() if t.numel() and not any(
        a <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= b for a, b in maps)]
    # Pages of the tensors written to (copy on write made them anonymous: pagemap bit 61 off).
    pagemap, written = os.open("/proc/self/pagemap", os.O_RDONLY), 0
    for t in tensors.values():
        first, end = t.data_ptr() // 4096, cdiv(t.data_ptr() + t.numel() * t.element_size(), 4096)
        for (entry,) in struct.iter_unpack("<Q", os.pread(pagemap, 8 * (end - first), 8 * first)):
            written += entry >> 63 & 1 and not entry >> 61 & 1
    engine.shutdown()
    print(json.dumps({"greedy": greedy, "copied": copied, "tensors": len(tensors),
                      "written_pages": written, "kernels": sorted(kernels)}))
""")


def greedy(engine: Engine) -> list[list]:
    """As ``_LOAD_SCRIPT`` reports it: each prompt's greedy tokens and their logprobs."""
    return [[tokens, [lp for _, lp, _ in logprobs]] for tokens, logprobs in outputs(
        engine, params=SamplingParams(max_tokens=8, temperature=0, logprobs=0))]


def run_without_compilers(tmp_path, lib: str, prompts=PROMPTS) -> dict:
    """``_LOAD_SCRIPT`` in a fresh process with an empty kernel cache and compilers on PATH
    that only leave a mark (the engine's other ranks inherit both)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "compiler-ran"
    for name in ("g++", "gcc", "c++", "cc", "clang", "clang++", "nvcc"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho \"$0 $@\" >> {mark}\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "LMSERVE_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, lib, json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not mark.exists(), mark.read_text()
    assert not (tmp_path / "cache" / "kernels").exists()
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_loading_maps_the_weights_and_compiles_nothing(tmp_path, library_dir, builtin_engine):
    result = run_without_compilers(tmp_path, library_dir)
    assert result["tensors"] > 100 and result["copied"] == []  # every tensor a view of the file
    assert result["written_pages"] == 0  # and none written to: their pages stay the page cache's
    assert {os.path.basename(k) for k in result["kernels"]} >= {"int8_gemm.so", "paged_attention.so"}
    assert all(k.startswith(library_dir) for k in result["kernels"])
    assert result["greedy"] == greedy(builtin_engine)


def test_a_parallel_library_equals_jit_and_compiles_nothing(tmp_path):
    """TP=2 x PP=2 of a 4-bit GGUF model at the default level: four rank files, each rank's
    shard of its stage. Served without compilers, every rank (and the all-reduce kernel the
    ranks load when they meet) uses the library's kernels, and the output is the JIT path's
    with the same split, bit for bit."""
    model = make_gguf_llama(str(tmp_path / "m.gguf"), "Q4_1", num_layers=4, seed=3)
    config = dict(model=model, tensor_parallel_shards=2, pipeline_parallel_stages=2)
    lib = str(tmp_path / "lib")
    info = compile_library(EngineConfig(**config), lib)
    assert sorted(f for f in info.files if f.startswith("rank-")) == \
        [f"rank-{r}.safetensors" for r in range(4)]
    library = ModelLibrary.open(lib)
    first, second = library.load_model(None, rank=0), library.load_model(None, rank=2)
    assert first.layer_ids == range(*info.stage_layers[0]) and first.lm_head is not None
    assert second.layer_ids == range(*info.stage_layers[1]) and second.lm_head is None
    assert second.layers[0].qkv.n < library.args.hidden_size * 3 // 2  # a shard of q, k and v
    jit = Engine(verbose=False, **config)
    try:
        expected = greedy(jit)
    finally:
        jit.shutdown()
    result = run_without_compilers(tmp_path, lib)
    assert "shm_all_reduce.so" in {os.path.basename(k) for k in result["kernels"]}
    assert result["greedy"] == expected


# -- a draft model from a library -----------------------------------------------------------------

def test_a_draft_model_from_a_library(tmp_path, builtin_engine):
    """small_draft with additional_models=[(path, lib)]: the draft is the built-in model compiled
    at O3 (its level is the library's), the target the built-in model at O2."""
    lib = str(tmp_path / "draft")
    compile_library(EngineConfig(opt="O3"), lib)
    engine = Engine(verbose=False, speculative_mode="small_draft", spec_draft_length=3,
                    additional_models=[(builtin_model_path(), lib)], max_num_sequence=8)
    try:
        assert outputs(engine) == outputs(builtin_engine)
        assert engine._core.draft_runner.model.layers[0].qkv.digits == 1  # O3: int8 activations
        assert engine.stats().spec_num_accepted_tokens > 0
    finally:
        engine.shutdown()


def test_a_draft_library_must_share_the_vocabulary(tmp_path):
    small_vocab = make_hf_llama(str(tmp_path / "draft"), num_layers=1, vocab_size=1000)
    lib = str(tmp_path / "lib")
    compile_library(EngineConfig(model=small_vocab), lib)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens and the model 49152"):
        Engine(verbose=False, speculative_mode="small_draft", additional_models=[(small_vocab, lib)])


# -- the server ------------------------------------------------------------------------------------

def test_serve_a_library(tmp_path, library_dir):
    import httpx

    with ServerProcess(["--model-lib", library_dir], str(tmp_path / "log")) as server:
        models = httpx.get(server.base_url + "/v1/models").json()
        assert models["data"][0]["id"] == os.path.basename(builtin_model_path())
        answer = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": models["data"][0]["id"], "prompt": "The capital of France is",
            "max_tokens": 3, "temperature": 0}).json()
        assert answer["choices"][0]["text"].strip().startswith("Paris")


def test_compile_and_plan_on_the_command_line(tmp_path, capsys):
    from lmserve.cli import main

    lib = str(tmp_path / "lib")
    assert main(["compile", "--opt", "O3", "--output", lib]) == 0
    assert f"serve it with: lmserve serve --model-lib {lib}" in capsys.readouterr().out
    assert main(["plan", "--model-lib", lib]) == 0
    out = capsys.readouterr().out
    assert f"model library {lib}: SmolLM2-135M-Instruct.Q4_1.gguf at opt O3" in out
    assert "kv_dtype                    int8" in out
    assert main(["compile", "--opt", "O0;compile=1", "--output", str(tmp_path / "x")]) == 1
    assert "compile=1 builds torch.compile graphs when the model loads" in capsys.readouterr().err


# -- the file format ------------------------------------------------------------------------------

def test_rank_files_are_safetensors_with_aligned_tensors(tmp_path):
    tensors = {"big": torch.arange(64, dtype=torch.float32).reshape(4, 16),
               "odd": torch.tensor([1, 2, 3], dtype=torch.uint8),
               "half": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0, 5)}
    path = str(tmp_path / "t.safetensors")
    write_tensors(path, tensors, {"k": "v"})
    with safetensors.safe_open(path, "pt") as f:  # the reference reader agrees
        assert f.metadata() == {"k": "v"}
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)
    mapped, metadata = read_tensors(path)
    assert metadata == {"k": "v"} and all(torch.equal(mapped[n], t) for n, t in tensors.items())
    assert mapped["big"].data_ptr() % 64 == 0 and mapped["half"].data_ptr() % 2 == 0


def test_the_tree_stores_only_known_classes():
    class Unknown:
        pass

    with pytest.raises(TypeError, match=r"layers.0: a Unknown cannot be stored"):
        to_tree({"layers": [Unknown()]})
    with pytest.raises(ValueError, match="holds a 'TensorShard', which lmserve does not load"):
        from_tree({"object": "TensorShard", "fields": {"rank": 0, "size": 2}}, {})
    with pytest.raises(ValueError, match="an entry lmserve does not read"):
        from_tree({"dtype": "load"}, {})  # a torch function, not a dtype
    tree, tensors = to_tree({"w": torch.ones(2), "again": None, "dt": torch.bfloat16, "r": range(2, 5)})
    assert from_tree(tree, tensors)["r"] == range(2, 5)
