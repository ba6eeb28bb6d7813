"""From sampled tokens to what callers see: text deltas, stop conditions, finish reasons."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmserve.engine.stop import StopChecker
from lmserve.outputs import SequenceDelta, TokenLogprob
from lmserve.request import Sequence
from lmserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _ChoiceState:
    detokenizer: IncrementalDetokenizer
    stop: Optional[StopChecker]


class OutputProcessor:
    """Appends each sampled token to its sequence and decides whether the sequence is done.

    Stop rules, in order: a ``stop_token_ids`` hit or (unless ``ignore_eos``) an end-of-sequence
    token; a stop string in the text (never a fragment of one reaches the caller); then
    ``max_tokens`` or the longest allowed sequence ("length"). Before ``min_tokens`` outputs, only
    the length limits apply. A structured-output sequence also stops ("stop") when its grammar is
    complete, even with ``ignore_eos``: no token may follow.
    """

    def __init__(self, tokenizer: Tokenizer, max_sequence_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.max_sequence_length = max_sequence_length

    def append(self, seq: Sequence, token_ids: list[int],
               logprobs: Optional[list[TokenLogprob]] = None) -> SequenceDelta:
        """Append a step's new tokens of ``seq`` (one, or an accepted run of several) in order.

        The stop rules act after each token exactly as if the tokens had come one step at a
        time: the first token that ends the sequence is its last, and the tokens after it are
        dropped (their logprobs too). Returns what the caller sees of the tokens kept.
        """
        p = seq.request.params
        if seq.output_state is None:
            seq.output_state = _ChoiceState(
                IncrementalDetokenizer(self.tokenizer, seq.request.prompt_token_ids,
                                       skip_special_tokens=p.skip_special_tokens),
                StopChecker(p.stop, p.include_stop_str_in_output) if p.stop else None,
            )
        if p.max_tokens == 0:  # the prompt only (echoed or scored): nothing is generated
            seq.finish_reason = "length"
            return SequenceDelta(seq.index, "", [], [] if logprobs is not None else None, "length")
        text, kept = "", 0
        for token_id in token_ids:
            text += self._append_one(seq, token_id)
            kept += 1
            if seq.finish_reason is not None:
                break
        return SequenceDelta(
            index=seq.index,
            text=text,
            token_ids=list(token_ids[:kept]),
            logprobs=list(logprobs[:kept]) if logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _append_one(self, seq: Sequence, token_id: int) -> str:
        """Append one token; returns the text it releases and sets the finish reason if it ends
        the sequence."""
        p = seq.request.params
        state: _ChoiceState = seq.output_state
        seq.token_ids.append(token_id)
        may_stop = seq.num_output_tokens >= p.min_tokens
        if seq.grammar is not None:
            seq.grammar.accept(token_id)

        text = ""
        if may_stop and token_id in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token_id
        elif (may_stop and not p.ignore_eos and token_id in self.eos_token_ids) or (
                seq.grammar is not None and seq.grammar.terminated):
            seq.finish_reason = "stop"
        else:
            text = state.detokenizer.push(token_id)
        if seq.finish_reason is None and (
            (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
            or len(seq.token_ids) >= self.max_sequence_length
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            text += state.detokenizer.flush()  # an incomplete character held back, if any
        if state.stop is not None and may_stop:
            text, matched = state.stop.feed(text)
            if matched is not None:
                seq.finish_reason, seq.stop_reason = "stop", matched
            elif seq.finish_reason is not None:
                text += state.stop.flush()  # held back as a possible stop string that never came
        return text
