"""Tokenizer: GGUF conversion cache, encode/decode, chat template, incremental detokenization."""

from __future__ import annotations

import os
import random
import time

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmserve.models.builtin import builtin_model_path
from lmserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "héllo wörld — naïve café",
    "emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 done",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "mixed 😀中文 text with numbers 12345 and code `x = f(y)`",
    "<|im_start|> written as plain text",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "中文?"},
    ],
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """A private, initially empty tokenizer cache for this module."""
    path = str(tmp_path_factory.mktemp("lmserve-cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMSERVE_CACHE_DIR", path)
        yield path


@pytest.fixture(scope="module")
def loads(cache_dir: str) -> tuple[Tokenizer, float, Tokenizer, float]:
    """The built-in tokenizer loaded twice: cold (GGUF conversion) and from the cache."""
    start = time.perf_counter()
    cold = Tokenizer.from_model(None)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    cached = Tokenizer.from_model(None)
    cached_s = time.perf_counter() - start
    return cold, cold_s, cached, cached_s


@pytest.fixture(scope="module")
def tok(loads) -> Tokenizer:
    return loads[2]


@pytest.fixture(scope="module")
def reference_hf():
    """transformers' own tokenizer for the GGUF file, converted directly (no cache)."""
    path = builtin_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_cache_makes_second_load_fast_and_identical(loads, cache_dir: str) -> None:
    cold, cold_s, cached, cached_s = loads
    assert cached_s < cold_s / 2, (cold_s, cached_s)
    for text in TEXTS:
        assert cached.encode(text) == cold.encode(text)
    assert cached.eos_token_ids == cold.eos_token_ids
    entries = os.listdir(os.path.join(cache_dir, "tokenizers"))
    assert len(entries) == 1 and not entries[0].startswith(".tmp")  # one entry, no leftovers


def test_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == [2]  # <|im_end|>: both eos and the template's end of turn
    assert tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, reference_hf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == reference_hf.encode(text, add_special_tokens=False)
    # Special-token text in the input becomes the special token (transformers' behaviour too).
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_in_decode(tok: Tokenizer) -> None:
    ids = [1] + tok.encode("hi") + [2]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, reference_hf, messages, add_generation_prompt) -> None:
    expected_text = reference_hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                     tokenize=False)
    expected_ids = reference_hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected_ids = expected_ids["input_ids"]
    assert tok.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected_text
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected_ids
    if add_generation_prompt:
        assert expected_text.endswith("<|im_start|>assistant\n")


def test_missing_chat_template_is_a_clear_error(tok: Tokenizer) -> None:
    hf = AutoTokenizer.from_pretrained(tok.hf.name_or_path)
    hf.chat_template = None
    bare = Tokenizer(hf)
    assert bare.eos_token_ids == [2]
    with pytest.raises(ValueError, match="has no chat template"):
        bare.apply_chat_template(CHATS[0])


def test_generation_config_eos_ids_are_added(tmp_path, tok: Tokenizer) -> None:
    tok.hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    assert Tokenizer.from_model(str(tmp_path)).eos_token_ids == [2, 0]


# ---------------------------------------------------------------- incremental detokenization


def _stream(tok: Tokenizer, prompt: list[int], generated: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [detok.push(token) for token in generated] + [detok.flush()]


def test_incremental_matches_full_decode_on_random_sequences(tok: Tokenizer) -> None:
    rng = random.Random(0)
    text_ids = [tok.encode(text) for text in TEXTS]
    for case in range(300):
        # Mix real text (multi-byte characters split across byte-level tokens), random
        # vocabulary ids (stray UTF-8 fragments) and special tokens.
        generated: list[int] = []
        length = rng.randint(1, 60)
        while len(generated) < length:
            kind = rng.random()
            if kind < 0.5:
                ids = rng.choice(text_ids)
                start = rng.randrange(len(ids))
                generated += ids[start : start + rng.randint(1, 12)]
            elif kind < 0.9:
                generated.append(rng.randrange(tok.vocab_size))
            else:
                generated.append(rng.randrange(17))  # special tokens
        prompt = tok.encode(rng.choice(TEXTS)) if case % 2 else []
        skip = case % 3 != 0
        pieces = _stream(tok, prompt, generated, skip)
        assert "".join(pieces) == tok.decode(generated, skip_special_tokens=skip), (prompt, generated)


def test_incremental_never_emits_half_characters(tok: Tokenizer) -> None:
    for text in TEXTS[2:6]:
        ids = tok.encode(text)
        pieces = _stream(tok, tok.encode("Say:"), ids)
        assert "".join(pieces) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_sequence_ending_mid_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    # Find a cut inside the emoji's bytes (byte-level BPE splits it over several tokens).
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.push(token) for token in ids[:cut])
    assert "\ufffd" not in streamed and tok.decode(ids[:cut]) == streamed + detok.flush()
    assert tok.decode(ids[:cut]).startswith(streamed) and streamed.startswith("ok")


def test_incremental_work_per_token_is_bounded(tok: Tokenizer, monkeypatch) -> None:
    ids = tok.encode(" ".join(TEXTS) * 20)
    seen: list[int] = []
    decode = tok.decode

    def spy(window, skip_special_tokens=True):
        seen.append(len(window))
        return decode(window, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    _stream(tok, ids[:100], ids[100:])
    assert len(ids) > 1000 and max(seen) <= 16


def _sentencepiece_tokenizer() -> Tokenizer:
    """A tiny Llama-2-style tokenizer: ▁ for spaces, byte fallback, leading space stripped on decode."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁Hello", "▁world", "Hello", "!", "▁the", "▁cat", ",", "a", "t", "c"]
    scores = [(piece, -1.0 if i > 258 else 0.0) for i, piece in enumerate(pieces)]
    model = models.Unigram(scores, unk_id=0, byte_fallback=True)
    rust = RustTokenizer(model)
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


def test_incremental_keeps_sentencepiece_leading_spaces() -> None:
    tok = _sentencepiece_tokenizer()
    prompt = tok.encode("Hello")
    generated = tok.encode("Hello world, the cat 中文 😀!")[1:]  # drop the first "▁Hello"
    assert tok.decode(generated).startswith("world")  # decoded alone, the first space is stripped
    pieces = _stream(tok, prompt, generated)
    assert pieces[0] == " world"
    full = tok.decode(prompt + generated)
    assert "".join(pieces) == full[len(tok.decode(prompt)) :] == " world, the cat 中文 😀!"
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(_stream(tok, [], generated)) == tok.decode(generated)


def test_encode_with_bos_matches_transformers(tok: Tokenizer, reference_hf) -> None:
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=True) == reference_hf.encode(text)


def test_truncation_or_padding_in_the_tokenizer_file_never_cuts_a_prompt(tmp_path) -> None:
    rust = RustTokenizer.from_file(os.path.join(_builtin_tokenizer_dir(tmp_path), "tokenizer.json"))
    rust.enable_truncation(max_length=4)
    rust.enable_padding(length=64)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust)
    text = "a sentence of more than four tokens, certainly"
    assert Tokenizer(hf).encode(text) == AutoTokenizer.from_pretrained(
        _builtin_tokenizer_dir(tmp_path)).encode(text, add_special_tokens=False)


def test_encoding_a_long_text_lets_other_threads_run(tok: Tokenizer) -> None:
    # The server tokenizes in worker threads; the event loop and the engine thread must keep
    # running meanwhile (the tokenizer's single-text call held the GIL: 0.5 s for 1 MB).
    import threading

    gaps, done = [], threading.Event()

    def ticker():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.02)
    ids = tok.encode("the sea and the ships " * 50_000)
    done.set()
    thread.join()
    assert len(ids) > 200_000
    assert max(gaps) < 0.15, f"another thread waited {max(gaps):.2f} s"


def _builtin_tokenizer_dir(tmp_path) -> str:
    path = tmp_path / "builtin_tokenizer"
    if not path.exists():
        AutoTokenizer.from_pretrained(os.path.dirname(builtin_model_path()),
                                      gguf_file=os.path.basename(builtin_model_path())).save_pretrained(path)
    return str(path)
