"""The kernels on every instruction set this CPU runs (kernels/build.py's one dispatch point,
``LMSERVE_ISA``): the same bits as on the best one, and the engine's invariants on each.

Each ISA runs in its own process (the ISA is chosen once per process, as a server's is)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lmserve.kernels.build import ISA_ENV, cpu_flags, kernel_isas, selected_isa, supported_isas, tile_state_granted
from lmserve.kernels.build import ISAS as ALL_ISAS

RUNS = [isa.name for isa in supported_isas()]  # what this CPU runs, best first
# The same, the one chosen by default first: the others are compared with it.
ISAS = sorted(RUNS, key=lambda name: name != getattr(selected_isa(), "name", None))
HERE = os.path.dirname(__file__)


def in_process_with(isa: str, call: str, timeout: float = 600) -> str:
    """stdout of ``call`` (a function of this file with its arguments) in a fresh Python process
    whose kernels are built for ``isa``."""
    env = {**os.environ, ISA_ENV: isa}
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_kernel_isas as t; t.{call}"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def layer_outputs(path: str) -> None:
    """Every matmul and fused kernel of this process's ISA on fixed inputs, saved to ``path``."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from lmserve.layers.blocks import BlockWeight, from_gguf_blocks
    from lmserve.layers.fused import FusedOps
    from lmserve.layers.linear import BlockLinear, DenseLinear

    torch.manual_seed(0)
    out = {}
    w = np.random.default_rng(0).standard_normal((70, 160)).astype(np.float32)
    for name in ("Q4_1", "Q8_0"):
        blocks = from_gguf_blocks(quantize(w, GGMLQuantizationType[name]), name, 70, 160)
        for m in (1, 5, 37):
            x = torch.randn(m, 160)
            x[:, 7] *= 20
            for act in ("int8", "int16", "float32", "bfloat16"):
                layer = BlockLinear(blocks, None, act)
                out[f"{name} {act} m={m}"] = layer(x if act != "bfloat16" else x.bfloat16())
            out[f"{name} reference m={m}"] = (x.double() @ blocks.dequantize().double().T).float()
    dense = DenseLinear(torch.from_numpy(w), None, torch.float32)
    for m in (1, 5, 37):
        out[f"float32 m={m}"] = dense(torch.randn(m, 160))
    bf16 = BlockLinear(BlockWeight.quantize(torch.from_numpy(w), 16), None)
    out["bf16 weights"] = bf16(torch.randn(9, 160).bfloat16())
    ops = FusedOps.create()
    x, delta, weight = torch.randn(6, 96), torch.randn(6, 96), torch.randn(96)
    out["add_rms_norm"] = ops.add_rms_norm(x, delta, weight, 1e-5, torch.float32)
    out["residual"] = x
    gate_up = torch.randn(6, 2 * 80) * 4
    out["silu_mul"] = ops.silu_mul(gate_up)
    print(json.dumps(sorted(out)))
    torch.save(out, path)


def greedy_alone_and_together(levels: str) -> None:
    """For each level, the built-in model's greedy tokens for four chat prompts alone and in
    each other's company, and where attention runs, as JSON."""
    sys.path.insert(0, HERE)
    from conftest import generate_tokens, run_concurrently
    from lmserve import Engine, SamplingParams
    from prompts import CHAT_PROMPTS

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    result = {}
    for opt in levels.split(","):
        engine = Engine(opt=opt, max_num_sequence=8, prefill_chunk_size=64, verbose=False)
        try:
            tok = engine.tokenizer
            prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:4]]
            alone = [generate_tokens(engine, p, greedy) for p in prompts]
            result[opt] = {"alone": alone, "together": run_concurrently(engine, prompts, greedy),
                           "attention": type(engine._core.runner.backend).__name__}
        finally:
            engine.shutdown()
    print(json.dumps(result))


def print_selected_isa() -> None:
    print(selected_isa().name)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("isas")
    result = {}
    for isa in ISAS:
        path = str(root / f"{isa}.pt")
        in_process_with(isa, f"layer_outputs({path!r})")
        result[isa] = torch.load(path)
    return result


def test_this_cpu_runs_more_than_one_isa():
    """Every x86-64 CPU with AVX-512 also runs the AVX2 build, so both are checked here; the
    default is the best this CPU runs but AMX, which is only chosen on request."""
    assert selected_isa() is not None and selected_isa().name == [n for n in RUNS if n != "amx"][0]
    if "avx512" in ISAS:
        assert "avx2" in ISAS


# The layer outputs of the bf16 kernel (float32 or bfloat16 activations, or bf16 weights): on
# AMX tiles their sums are TDPBF16PS's, other last bits than the vector path's
# (kernels/block_gemm.cpp). The built-in model's matmuls take that kernel at O1 only (its blocks
# are Q4_1 and Q8_0, which O2 and O3 multiply in the int8 kernel).
def on_bf16_kernel(name: str) -> bool:
    return name == "bf16 weights" or " float32 m=" in name or " bfloat16 m=" in name


def amx_tiles_run(isa: str) -> bool:
    """Whether the ``isa`` build multiplies on AMX tiles on this machine."""
    return isa == "amx" and "amx_tile" in cpu_flags() and tile_state_granted()


def test_every_isa_gives_the_best_isas_bits(outputs):
    """The int8 matmul's integer dot products, the bf16 pair products (FMAs where vdpbf16ps is
    missing), the float32 matmul's FMAs, the reductions in one order and the exp polynomial: the
    same bits on every ISA; the bf16 kernel on AMX tiles within float32's rounding of them (a
    bf16 step for bf16 outputs)."""
    best = outputs[ISAS[0]]
    for isa in ISAS[1:]:
        for name, value in best.items():
            if amx_tiles_run(isa) and on_bf16_kernel(name):  # float32 rounding, or a bf16 step
                got, want = outputs[isa][name].float(), value.float()
                allowed = 1e-5 * want.abs().max() + (want.abs() * 2**-7 if value.dtype == torch.bfloat16 else 0)
                assert ((got - want).abs() <= allowed).all(), f"{name} on {isa}"
            else:
                assert torch.equal(outputs[isa][name], value), f"{name} on {isa}"


# Largest error against a float64 matmul of the same weights, relative to the output's scale,
# per activation format (float32 and bfloat16 go through the bf16 kernel, whose weights are
# rounded to bf16). About 3x what they err by on these inputs (3.4e-3, 5.4e-5, 7.6e-3, 1.5e-2);
# test_block_weights bounds them exactly by their rounding.
TOLERANCE = {"float32": 1e-2, "int16": 2e-4, "bfloat16": 2.5e-2, "int8": 5e-2}


def test_every_isa_is_close_to_the_float_reference(outputs):
    """Each path against the O0 reference (float64 torch on the same weights)."""
    for isa, out in outputs.items():
        for name, value in out.items():
            assert value.isfinite().all(), f"{name} on {isa}"
        for name in ("Q4_1", "Q8_0"):
            for m in (1, 5, 37):
                ref = out[f"{name} reference m={m}"]
                for act, tol in TOLERANCE.items():
                    err = (out[f"{name} {act} m={m}"].float() - ref).abs().max()
                    assert err < tol * ref.abs().max(), f"{name} {act} m={m} on {isa}: {err}"


def test_the_isa_can_be_chosen_and_a_wrong_choice_is_refused():
    assert in_process_with(ISAS[-1], "print_selected_isa()").strip() == ISAS[-1]
    for wanted, message in [("sse2", "unknown; the kernels are built for amx, avx512, avx2, neon"),
                            ("neon" if "neon" not in ISAS else "avx512", "this CPU runs")]:
        env = {**os.environ, ISA_ENV: wanted}
        result = subprocess.run([sys.executable, "-c", "from lmserve import Engine; Engine()"], env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode != 0 and f"{ISA_ENV}={wanted!r}" in result.stderr
        assert message in result.stderr


def print_kernels() -> None:
    from lmserve.kernels.build import describe_kernels

    print(describe_kernels())


def test_the_plan_says_where_each_op_runs():
    """`lmserve plan` and the start-up log: the ISA, the C++ ops, and the torch ones with why."""
    for isa in ISAS:
        line = in_process_with(isa, "print_kernels()").strip()
        assert line.startswith(f"{isa} (this CPU runs {', '.join(RUNS)}; {ISA_ENV} chooses)")
        assert line.endswith("; C++: int8-activation matmuls, block and bf16 matmuls, float32 matmuls, "
                             "attention, norm and SiLU, recurrent decode, tensor-parallel all-reduce")


def test_the_plan_names_what_the_amx_build_multiplies_on_tiles(monkeypatch):
    from lmserve.kernels import build

    assert ("AMX tiles" in build.describe_kernels()) == (selected_isa().name == "amx")
    monkeypatch.setattr(build, "selected_isa", lambda: next(i for i in ALL_ISAS if i.name == "amx"))
    line = build.describe_kernels()
    assert line.startswith("amx (") and ("; AMX tiles: int8-activation matmuls of 16 rows or more, block "
                                         "and bf16 matmuls; C++: int8-activation matmuls, block and bf16") in line


KERNELS = ["int8_gemm", "block_gemm", "dense_gemm", "fused_ops", "paged_attention", "ssm_decode", "shm_all_reduce",
           "call_list", "decode_chain"]


def test_every_kernel_is_built_for_every_isa():
    """Every kernel has a version for each vector ISA; the AMX build has tile paths in the int8
    and bf16 matmuls, and builds every other kernel for AVX-512, which it extends."""
    assert all(kernel_isas(name)[-3:] == ["avx512", "avx2", "neon"] for name in KERNELS)
    assert [name for name in KERNELS if "amx" in kernel_isas(name)] == ["int8_gemm", "block_gemm"]


@pytest.mark.skipif(len(ISAS) < 2, reason="this CPU runs one instruction set")
def test_greedy_output_is_batch_invariant_on_the_other_isas():
    """The hard rule at every level on every ISA but the best (whose run is the rest of the
    suite): greedy tokens alone equal those in batch company, and the same tokens as on the best
    ISA (the kernels give the same bits; not O1's bf16 matmuls on AMX tiles)."""
    levels = "O0,O1,O2,O3"
    best = json.loads(in_process_with(ISAS[0], f"greedy_alone_and_together({levels!r})"))
    for isa in ISAS[1:]:
        result = json.loads(in_process_with(isa, f"greedy_alone_and_together({levels!r})"))
        for opt, r in result.items():
            assert r["alone"] == r["together"], f"{opt} on {isa}"
            if not (opt == "O1" and amx_tiles_run(isa)):
                assert r["alone"] == best[opt]["alone"], f"{opt} on {isa}"
            assert all(len(t) == 24 for t in r["alone"])
            assert r["attention"] == "CpuPagedBackend"


PORTABLE_KERNELS = ["int8_gemm", "block_gemm", "dense_gemm", "fused_ops"]
_AVX512 = next(isa for isa in ALL_ISAS if isa.name == "avx512")
# Every build of a harness in tests/native: (name, the ISA the CPU must run, compiler, flags, how
# to run it). The x86 ones take the kernels' own flags; "amx emulated" is the AMX build with the
# tile instructions in software (native/amx_emulator.h), so its tile paths run on any AVX-512 CPU;
# the Arm builds are cross-compiled with Debian's aarch64 toolchain and run under qemu-user
# (`-cpu max` has the i8mm extension the second one uses).
HARNESS_BUILDS = [
    *[(isa.name, "avx512" if isa.name == "amx" else isa.name, "g++", list(isa.flags), [])
      for isa in ALL_ISAS if isa.machine == "x86_64"],
    ("amx emulated", "avx512", "g++",
     [*_AVX512.flags, "-DLM_AMX=1", "-DLM_AMX_EMULATED=1", "-I", os.path.join(HERE, "native")], []),
    ("neon dotprod", None, "aarch64-linux-gnu-g++", ["-march=armv8.2-a+dotprod"],
     ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]),
    ("neon i8mm", None, "aarch64-linux-gnu-g++", ["-march=armv8.2-a+dotprod+i8mm"],
     ["qemu-aarch64", "-cpu", "max", "-L", "/usr/aarch64-linux-gnu"]),
]


def compile_all(commands: list[list[str]]) -> None:
    """Runs the compiler ``commands``, as many at once as there are cores (compiling is most of
    these tests' time)."""
    def compile_one(command: list[str]) -> None:
        subprocess.run(command, check=True, capture_output=True, timeout=600)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, commands))


def run_harness(harness: str, kernels: list[str], tmp_path, tile_builds: bool = False
                ) -> dict[str, subprocess.CompletedProcess]:
    """tests/native/``harness``.cpp with ``kernels`` built and run for every ISA this machine
    can run (x86 ones this CPU has, AMX's on any AVX-512 CPU, and with ``tile_builds`` its
    emulated tiles too; the Arm ones under qemu-user), each run's result by build."""
    tools = ["aarch64-linux-gnu-g++", "qemu-aarch64"]
    missing = [t for t in tools if shutil.which(t) is None]
    if missing and not os.environ.get("CI"):
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup.sh installs them as root)")
    assert not missing, f"CI must have {', '.join(missing)} (scripts/setup.sh)"
    sources = [os.path.join(HERE, "native", f"{harness}.cpp")] + [
        os.path.join(HERE, "..", "lmserve", "kernels", f"{k}.cpp") for k in kernels]
    builds = [(name, compiler, flags, runner, str(tmp_path / f"{harness}-{name.replace(' ', '_')}"))
              for name, needs, compiler, flags, runner in HARNESS_BUILDS
              # not an x86 ISA this CPU lacks, nor tiles the kernels don't use
              if (needs is None or needs in ISAS) and (tile_builds or not name.startswith("amx"))]

    compile_all([[compiler, "-O2", "-fopenmp", "-std=c++17", *flags, *sources, "-o", binary]
                 for _, compiler, flags, _, binary in builds])
    runs = {}
    for name, _, _, runner, binary in builds:
        runs[name] = subprocess.run([*runner, binary], capture_output=True, timeout=600)
        assert runs[name].returncode == 0, f"{name}: {runs[name].stderr.decode()}"
    assert len(runs) >= 3
    return runs


def test_every_build_matches_a_scalar_reference_and_each_others_bits(tmp_path):
    """The portable kernels built for AMX, AVX-512, AVX2 and Arm64 NEON (with and without i8mm,
    under qemu-user): each within its stated tolerance of a plain scalar reference written from the
    layouts (int8 activations: 3e-2 of the output scale for one digit, 3e-4 for two; bf16
    matmul: 1e-5 with bf16 activations, 2e-4 with float32 ones; float32 matmul 1e-6; norm 1e-5;
    SiLU 1e-6), every matmul row the same bits alone as in a batch, and all with the same bits.
    The AMX build multiplies on tiles where the CPU has them, and runs on any AVX-512 CPU:
    without tiles it takes its vector paths; the emulated tiles' build runs its tile paths
    everywhere. The bf16 matmul's tiles sum in another order (TDPBF16PS): they are held to the
    reference and to batch invariance, and the harness writes out the vector path's bits, run
    in the same process."""
    runs = run_harness("isa_harness", PORTABLE_KERNELS, tmp_path, tile_builds=True)
    assert "amx emulated" in runs or "avx512" not in ISAS
    for name, run in runs.items():
        tiles = name == "amx emulated" or amx_tiles_run(name)
        for kernel in ("int8_gemm", "block_gemm"):
            assert f"{kernel} tiles: {'on' if tiles else 'off'}" in run.stderr.decode(), name
    assert len({run.stdout for run in runs.values()}) == 1, {name: len(r.stdout) for name, r in runs.items()}


def test_attention_on_every_build_matches_a_scalar_reference_and_each_others_bits(tmp_path):
    """The paged attention kernel (rotary, cache store, causal attention; a prefill step of two
    sequences and a decode step; dense and under a sliding window with sinks; float32, bf16 and
    int8 caches) on every build: float32 within 1e-5 of the output scale of a scalar reference,
    and every output and cache byte the same on each."""
    runs = run_harness("attention_harness", ["paged_attention"], tmp_path)
    assert len({run.stdout for run in runs.values()}) == 1, {name: len(r.stdout) for name, r in runs.items()}


def test_every_kernel_compiles_for_arm64(tmp_path):
    """The kernels the harnesses do not run (the recurrent decode, the all-reduce, the call
    list) build for Arm64 too."""
    if shutil.which("aarch64-linux-gnu-g++") is None and not os.environ.get("CI"):
        pytest.skip("aarch64-linux-gnu-g++ not installed (scripts/setup.sh installs it as root)")
    compile_all([["aarch64-linux-gnu-g++", "-O1", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
                  "-march=armv8.2-a+dotprod", os.path.join(HERE, "..", "lmserve", "kernels", f"{name}.cpp"),
                  "-o", str(tmp_path / f"{name}.so")] for name in KERNELS])
