"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's request and response shapes.

``/tokenize`` takes a text ``prompt`` (tokenized as ``/v1/completions`` would, with the model's
BOS unless ``add_special_tokens`` is false) or chat ``messages`` (rendered with the chat template
as ``/v1/chat/completions`` would; ``add_special_tokens`` adds the tokenizer's BOS on top), and
answers ``{count, max_model_len, tokens, token_strs}``.
``/detokenize`` takes ``tokens`` and answers ``{prompt}``.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Optional

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmserve.errors import InvalidRequestError
from lmserve.frontend.openai.facades import check_text_fits, render_chat_prompt, template_message
from lmserve.frontend.openai.protocol import ChatMessageParam, ChatTool, check_json_values, invalid_request
from lmserve.frontend.server.backend import ServedModel
from lmserve.frontend.server.routes import api_access
from lmserve.frontend.server.state import server_state

router = APIRouter(dependencies=[Depends(api_access)])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None


class TokenizeTextRequest(_Strict):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    # The tokenizer's own decoration (a BOS) on top of what the template writes, as vLLM has it.
    add_special_tokens: bool = False
    tools: Optional[list[ChatTool]] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[Annotated[int, Field(ge=0)]]


def _parse(model: type[_Strict], body: dict[str, Any]) -> Any:
    check_json_values(body)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise invalid_request(err, body) from None


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """Token ids of a prompt or of a rendered chat."""
    state = server_state(request)
    body = await state.read_body(request)
    state.check_model(body.get("model"))
    # In a worker thread: tokenizing a long text must not hold up the event loop.
    return await state.offload.run(functools.partial(_tokenize, state.model, body))


def _tokenize(model: ServedModel, body: dict[str, Any]) -> dict[str, Any]:
    tokenizer = model.tokenizer
    if "messages" in body:
        req = _parse(TokenizeChatRequest, body)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        messages = [template_message(m) for m in req.messages]
        check_text_fits(sum(len(m.get("content") or "") for m in messages), model, "messages")
        # As the chat endpoint renders it (with tools, its default tool_choice "auto").
        ids, _ = render_chat_prompt(tokenizer, messages, tools, show_tool_prompt=bool(tools),
                                    add_generation_prompt=req.add_generation_prompt,
                                    add_special_tokens=req.add_special_tokens)
    else:
        req = _parse(TokenizeTextRequest, body)
        check_text_fits(len(req.prompt), model, "prompt")
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
            "token_strs": tokenizer.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """The text of token ids."""
    state = server_state(request)
    body = await state.read_body(request)
    state.check_model(body.get("model"))
    req = _parse(DetokenizeRequest, body)
    tokenizer = state.model.tokenizer
    bad = next((t for t in req.tokens if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary (ids 0.."
                                  f"{tokenizer.vocab_size - 1})", "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}
