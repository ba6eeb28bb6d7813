"""Text <-> token ids for a model, its chat template, and streaming (incremental) detokenization."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Optional, Sequence

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lmserve.models.gguf_reader import read_gguf_args
from lmserve.models.loader import resolve_model_path

TokenBytes = Callable[[int], bytes]  # token id -> the raw bytes it stands for

# Stands in for an assistant reply when rendering the template to find its end-of-turn token.
_PROBE = "LMSERVE_END_OF_TURN_PROBE"


class Tokenizer:
    """A model's Hugging Face fast tokenizer plus the few things serving needs on top of it."""

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()) -> None:
        """Wrap ``hf``; ``extra_eos_token_ids`` are stop tokens beyond its eos (e.g. generation_config's)."""
        if not hf.is_fast:
            raise TypeError(f"lmserve needs a fast (Rust) tokenizer, got {type(hf).__name__}")
        self._hf = hf
        self._extra_eos_token_ids = [int(i) for i in extra_eos_token_ids]
        # The Rust tokenizer's decode skips transformers' Python-side post-processing, which keeps
        # streaming cheap and makes decode() and IncrementalDetokenizer agree character for character.
        self._backend = hf.backend_tokenizer
        # A tokenizer.json may carry truncation or padding, which would cut or pad prompts;
        # transformers turns them off on every call, lmserve once (encode only reads).
        self._backend.no_truncation()
        self._backend.no_padding()
        eos: list[int] = []
        candidates = [hf.eos_token_id, *extra_eos_token_ids, *self._template_end_of_turn_ids()]
        for token_id in candidates:
            if token_id is not None and int(token_id) not in eos:
                eos.append(int(token_id))
        self._eos_token_ids = eos

    @classmethod
    def from_model(cls, model: Optional[str]) -> "Tokenizer":
        """Load the tokenizer of a model: ``None`` (built-in), a ``.gguf`` file or a Hugging Face directory.

        A GGUF file's tokenizer is converted once (seconds) and cached as a Hugging Face tokenizer
        under ``$LMSERVE_CACHE_DIR/tokenizers`` (default ``~/.cache/lmserve/tokenizers``).
        """
        path = resolve_model_path(model)
        if os.path.isfile(path):
            path = _cached_gguf_tokenizer_dir(path)
        return cls.from_pretrained_dir(path)

    @classmethod
    def from_pretrained_dir(cls, path: str) -> "Tokenizer":
        """Load a tokenizer saved in Hugging Face form (a model directory, or ``save_pretrained``'s),
        with the extra stop tokens of its ``generation_config.json``."""
        return cls(AutoTokenizer.from_pretrained(path), _generation_config_eos_ids(path))

    def save_pretrained(self, path: str) -> None:
        """Save the tokenizer and chat template in Hugging Face form, with the extra stop tokens
        it was given, so that ``from_pretrained_dir(path)`` loads this very tokenizer."""
        self._hf.save_pretrained(path)
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": self._extra_eos_token_ids}, f)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The underlying Hugging Face tokenizer."""
        return self._hf

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end generation: eos, generation_config's eos list and the template's end-of-turn."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> Optional[int]:
        """The beginning-of-sequence id, or None when the tokenizer has none."""
        return self._hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._hf)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for.

        A vocabulary piece has at least as many characters as the text it stands for: byte-level
        pieces spell each byte as one character, SentencePiece pieces each character as itself.
        A normalizer may shrink text before it is split (NFKC composes characters), so with one
        the bound is four times looser.
        """
        longest = max(len(piece) for piece in self._hf.get_vocab())
        return longest * (4 if self._backend.normalizer is not None else 1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the tokenizer's bos/eos decoration.

        Safe from several threads at once, and lets other threads run meanwhile: the Rust
        tokenizer is only read (transformers' own encode may first reset truncation and padding
        on the shared object, which PyO3 refuses while another thread encodes: "RuntimeError:
        Already borrowed"), and its batch call, unlike its single one, releases the GIL.
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 character decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> str:
        """Render ``messages`` (and ``tools``) with the model's own chat template."""
        if not self._hf.chat_template:
            raise ValueError(
                f"the tokenizer of {self._hf.name_or_path!r} has no chat template; "
                "send a plain completion prompt instead"
            )
        # transformers annotates no overload for tokenize=False (a str) and wants tools as an
        # invariant list[dict | Callable]
        return self._hf.apply_chat_template(  # type: ignore[return-value]
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False  # type: ignore[arg-type]
        )

    @functools.cached_property
    def template_renders_tools(self) -> bool:
        """Whether the chat template writes the tools it is given into the prompt (probed once)."""
        probe_tool = {"type": "function", "function": {"name": "lmserve_probe_tool", "parameters": {}}}
        try:
            rendered = self.render_chat([{"role": "user", "content": "hi"}], tools=[probe_tool])
        except Exception:  # noqa: BLE001  (a template may refuse tools in its own way)
            return False
        return "lmserve_probe_tool" in rendered

    @property
    def chat_template(self) -> Optional[str]:
        """The chat template's text, or None."""
        template = self._hf.chat_template
        return template if isinstance(template, str) or template is None else str(template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of the rendered chat. The template writes any bos itself, so none is added
        unless ``add_special_tokens`` asks for the tokenizer's decoration on top."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens)

    def _template_end_of_turn_ids(self) -> list[int]:
        """The special token the chat template writes right after an assistant reply (e.g. <|im_end|>)."""
        if not self._hf.chat_template:
            return []
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            rendered = self.render_chat(probe, add_generation_prompt=False)
        except Exception:  # a template may reject this minimal chat; then only eos stops generation
            return []
        _, found, after = rendered.partition(_PROBE)
        # Llama 2-style templates write "reply </s>": the space before the token is not part of it.
        ids = self.encode(after.lstrip(" "), add_special_tokens=False) if found else []
        added = self._hf.added_tokens_decoder
        if ids and ids[0] in added and added[ids[0]].special:
            return [ids[0]]
        return []


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text, emitting each character once it is final.

    Each push decodes only a short window of recent tokens: ``prefix_offset..read_offset`` is text
    already emitted, kept as context so that tokenizers which drop a leading space at the start of
    a decode (SentencePiece) or need neighbouring bytes (byte-level BPE) decode the new tokens the
    same way as inside the whole sequence; the new text is what the window adds beyond that
    context. Text ending in U+FFFD is held back, since the character may still be incomplete.
    """

    _CONTEXT_TOKENS = 5  # prompt tokens used as context for the first generated tokens

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        """Start after ``prompt_ids``, which give the first generated tokens their context."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)
        self._prefix_offset = max(len(self._ids) - self._CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became final (often "")."""
        self._ids.append(token_id)
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) > len(self._prefix_text) and not text.endswith("\ufffd"):
            return self._advance(text)
        return ""

    def flush(self) -> str:
        """At the end of generation, return any held text (an incomplete character as U+FFFD)."""
        text = self._decode(self._prefix_offset, len(self._ids))
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return new_text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)


def _cache_root() -> str:
    root = os.environ.get("LMSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "lmserve")
    return os.path.join(root, "tokenizers")


def _cached_gguf_tokenizer_dir(gguf_path: str) -> str:
    """Directory holding the GGUF file's tokenizer in Hugging Face form, converting it on first use.

    The key covers the file's identity (path, size, mtime) and the transformers version that
    converted it. The conversion is written to a temporary directory and renamed into place,
    so a concurrent or interrupted conversion never leaves a half-written entry.
    """
    stat = os.stat(gguf_path)
    identity = f"{os.path.abspath(gguf_path)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    root = _cache_root()
    target = os.path.join(root, hashlib.sha256(identity.encode()).hexdigest()[:32])
    if os.path.isdir(target):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
        hf.save_pretrained(tmp)
        # GGUF's eos/eot/eom ids are saved the way a Hugging Face directory lists them.
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": read_gguf_args(gguf_path).eos_token_ids}, f)
        os.rename(tmp, target)
    except OSError:
        if not os.path.isdir(target):  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _generation_config_eos_ids(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    return [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]


def _gpt2_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def hf_token_bytes(hf: Any) -> TokenBytes:
    """``token id -> raw bytes`` for a Hugging Face tokenizer.

    ``decode([id])`` is not enough: it drops SentencePiece's leading space and turns a token that
    holds part of a UTF-8 character into U+FFFD. So read the vocabulary piece instead and undo
    the vocabulary's own byte encoding: GPT-2's printable-character table for byte-level BPE,
    ``▁`` for space and ``<0xNN>`` byte-fallback pieces for SentencePiece. Added tokens (chat
    markers and the like) are stored as plain text.
    """
    probe = hf.convert_ids_to_tokens(hf.encode(" a", add_special_tokens=False))
    byte_level = any("Ġ" in piece for piece in probe)  # GPT-2's spelling of a space
    char_to_byte = _gpt2_char_to_byte()
    added = set(hf.get_added_vocab().values())

    def token_bytes(token_id: int) -> bytes:
        piece = hf.convert_ids_to_tokens(token_id)
        if token_id in added:
            return piece.encode()
        if byte_level and all(c in char_to_byte for c in piece):
            return bytes(char_to_byte[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    return token_bytes
