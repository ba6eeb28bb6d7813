"""The ``lmserve`` command line: engine flags -> EngineConfig, and ``lmserve chat`` end to end."""

import dataclasses
import io
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lmserve.cli import build_parser, main
from lmserve.config import EngineConfig
from lmserve.engine_args import engine_config_from_args
from lmserve.frontend.chat_cli import AnswerStats, run_chat
from lmserve.frontend.openai.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, Usage


def parse_chat(*argv: str):
    return build_parser().parse_args(["chat", *argv])


# ---------------------------------------------------------------------------------------------
# Engine flags


def test_every_config_field_has_a_flag(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in help_text


def test_no_flags_give_the_defaults_but_a_quiet_chat():
    assert engine_config_from_args(parse_chat()) == EngineConfig(verbose=False)
    assert engine_config_from_args(parse_chat("--verbose")).verbose is True


def test_flags_map_to_config_fields():
    config = engine_config_from_args(parse_chat(
        "--model", "m.gguf", "--max-num-sequence", "8", "--prefill-chunk-size", "256",
        "--opt", "O1;kv_dtype=bfloat16", "--mode", "server", "--gpu-memory-utilization", "0.5",
        "--prefix-cache-mode", "disable", "--no-verbose", "--speculative-mode", "medusa",
        "--additional-models", "heads", "--additional-models", "more", "heads2",
    ))
    assert config == EngineConfig(
        model="m.gguf", max_num_sequence=8, prefill_chunk_size=256, opt="O1;kv_dtype=bfloat16",
        mode="server", gpu_memory_utilization=0.5, prefix_cache_mode="disable", verbose=False,
        speculative_mode="medusa", additional_models=["heads", "more", "heads2"],
    )
    assert engine_config_from_args(parse_chat(  # PATH,MODEL_LIB: a draft model's library
        "--speculative-mode", "small_draft", "--additional-models", "draft.gguf,draft-lib")) == EngineConfig(
        speculative_mode="small_draft", additional_models=[("draft.gguf", "draft-lib")], verbose=False)
    assert engine_config_from_args(parse_chat(
        "--speculative-mode", "ngram", "--spec-draft-length", "3")) == EngineConfig(
        speculative_mode="ngram", spec_draft_length=3, verbose=False)


@pytest.mark.parametrize("argv, message", [
    (["--max-num-sequence", "many"], "argument --max-num-sequence: invalid int value: 'many'"),
    (["--mode", "batch"], "argument --mode: invalid choice: 'batch'"),
    (["--gpu-memory-utilization", "x"], "argument --gpu-memory-utilization: invalid float value"),
    # Values only EngineConfig refuses are reported the same way.
    (["--max-num-sequence", "0"], "argument --max-num-sequence: max_num_sequence must be"),
    (["--kv-cache-page-size", "12"], "argument --kv-cache-page-size: kv_cache_page_size must be"),
    (["--opt", "O9"], "argument --opt: opt: unknown level 'O9'"),
    (["--attention-sink-size", "4"], "argument --attention-sink-size: attention_sink_size=4 needs"),
    (["--spec-draft-length", "4"], "argument --spec-draft-length: spec_draft_length=4 needs "
                                   "speculative decoding"),
    (["--speculative-mode", "lookup"], "argument --speculative-mode: invalid choice: 'lookup'"),
    # Sampling flags are checked before the model loads.
    (["--temperature", "3"], "argument --temperature: Input should be less than or equal to 2"),
    (["--top-p", "0"], "argument --top-p:"),
    (["--max-tokens", "0"], "argument --max-tokens:"),
])
def test_bad_values_are_argparse_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lmserve chat")
    assert f"lmserve chat: error: {message}" in err


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit):
        main([])
    assert "required: COMMAND" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The chat loop, on a scripted engine


class ScriptedEngine:
    """Answers every turn with "ok <number of messages>" and records what it was sent."""

    model_name = "scripted"

    def __init__(self):
        self.requests = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, messages, **kwargs):
        self.requests.append(([dict(m) for m in messages], kwargs))
        text = f"ok {len(messages)}"

        def chunk(choices, usage=None):
            return ChatCompletionChunk(id="c", created=0, model="scripted", choices=choices,
                                       usage=usage)

        yield chunk([ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content="ok"))])
        yield chunk([ChatChunkChoice(index=0, delta=ChatDelta(content=text[2:]),
                                     finish_reason="stop")])
        yield chunk([], Usage(prompt_tokens=10 * len(messages), completion_tokens=2,
                              total_tokens=10 * len(messages) + 2))


def test_chat_sends_the_history_and_reset_keeps_the_system_prompt():
    engine = ScriptedEngine()
    out = io.StringIO()
    status = run_chat(engine, system="be brief", options={"temperature": 0.0},
                      stdin=io.StringIO("one\ntwo\n/reset\nthree\n"), out=out)
    assert status == 0
    sent = [messages for messages, _ in engine.requests]
    system = {"role": "system", "content": "be brief"}
    assert sent[1] == [system, {"role": "user", "content": "one"},
                       {"role": "assistant", "content": "ok 2"}, {"role": "user", "content": "two"}]
    assert sent[2] == [system, {"role": "user", "content": "three"}]
    assert all(kwargs["temperature"] == 0.0 and kwargs["stream"] for _, kwargs in engine.requests)
    assert "You: one\nAssistant: ok 2\n" in out.getvalue()


def test_answer_stats():
    stats = AnswerStats(prompt_tokens=30, completion_tokens=11, time_to_first_token=0.5,
                        decode_time=2.0)
    assert stats.prefill_tokens_per_s == 60.0
    assert stats.decode_tokens_per_s == 5.0
    assert "decode: n/a" in AnswerStats(30, 1, 0.5, 0.0).describe()


# ---------------------------------------------------------------------------------------------
# `python -m lmserve.cli chat` with the built-in model, input piped in

STATS = re.compile(r"prefill: ([\d.]+) tokens/s \((\d+) prompt tokens.*\ndecode: ([\d.]+) tokens/s")


def test_chat_subprocess_end_to_end():
    turns = ["Hi", "/stats", "What is the capital of France?", "/stats", "/reset", "Hi", "/stats",
             "/frobnicate", "/exit", "never read"]
    proc = subprocess.run(
        [sys.executable, "-m", "lmserve.cli", "chat", "--max-tokens", "16", "--temperature", "0"],
        input="\n".join(turns) + "\n", capture_output=True, text=True, encoding="utf-8",
        timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    banner, *exchanges = out.split("You: ")
    assert "SmolLM2" in banner and "/help" in banner
    # Each exchange is the echoed input line, then what the chat printed in reply.
    replies = dict(enumerate(exchange.partition("\n")[2] for exchange in exchanges))
    assert [exchange.partition("\n")[0] for exchange in exchanges] == turns[:9]

    answers = [replies[i] for i in (0, 2, 5)]
    for answer in answers:
        assert answer.startswith("Assistant: ") and answer.removeprefix("Assistant: ").strip()
    stats = [STATS.search(replies[i]) for i in (1, 3, 6)]
    assert all(stats), out
    for match in stats:
        assert float(match.group(1)) > 0 and float(match.group(3)) > 0
    prompt_tokens = [int(match.group(2)) for match in stats]
    # The second question is sent with the first exchange; after /reset only the question again.
    assert prompt_tokens[1] > prompt_tokens[0]
    assert prompt_tokens[2] == prompt_tokens[0]
    assert answers[2] == answers[0]  # greedy, same conversation -> same answer
    assert "unknown command '/frobnicate'" in replies[7] and "/reset" in replies[7]
    assert "never read" not in out
