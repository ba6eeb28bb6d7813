"""The API key check: OpenAI's ``Authorization: Bearer <key>``."""

from __future__ import annotations

import secrets

from fastapi import Request

from lmserve.frontend.server.errors import APIError


def check_api_key(request: Request, api_key: str) -> None:
    """Raise 401 unless the request carries ``api_key`` as its bearer token."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken must not tell how much of a guessed key was right.
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        message = ("no API key given: send it as 'Authorization: Bearer <key>'" if not token
                   else "the API key is not valid")
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
