"""The CLI's calls to a running server, and how it says the two failures every such call shares: no
server answering, and a key missing or refused, told as the options that give a key (the server's
own message speaks to HTTP clients: `Authorization: Bearer <key>`)."""

from __future__ import annotations

from typing import Any

import httpx

from appliance.cli.exits import UNREACHABLE, CommandError

KEY_OPTIONS = "pass --key KEY, set APPLIANCE_KEY, or name a file holding it with --key-file PATH (or APPLIANCE_KEY_FILE)"


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_error(response: httpx.Response) -> tuple[str, str]:
    """(code, message) of an OpenAI-style error body; ("", the start of the body) for any other."""
    try:
        error = response.json()["error"]
        return str(error.get("code") or ""), str(error["message"])
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not an error envelope
        return "", response.text[:200]


def unreachable(url: str, exc: Exception) -> CommandError:
    return CommandError(f"no server answers at {url} ({exc}): start one with `appliance serve`, "
                        "or name another with --url or APPLIANCE_URL", UNREACHABLE)


def refusal(url: str, response: httpx.Response, key: str | None) -> str | None:
    """What to tell the user of a 401 or an admin-only 403, in the CLI's words; None for other answers."""
    code, message = server_error(response)
    if response.status_code == 401:
        if not key:
            return f"the server at {url} asks for an API key: {KEY_OPTIONS}"
        return f"the server at {url} refused the key ({message.rstrip('.')}): give a current one ({KEY_OPTIONS})"
    if response.status_code == 403 and code == "admin_required":
        if not key:
            return f"the server at {url} needs an admin key for this: {KEY_OPTIONS}"
        return f"the server at {url} needs an admin key for this, and this key is not one (`appliance keys create --admin` makes one)"
    return None


def call(url: str, key: str | None, method: str, path: str, *, timeout: float = 10, **kwargs: Any) -> httpx.Response:
    """The server's 2xx answer; a CommandError for no answer (exit UNREACHABLE), a key refused, or any other error status."""
    url = url.rstrip("/")
    try:
        response = httpx.request(method, f"{url}{path}", headers=auth_headers(key), timeout=timeout, **kwargs)
    except httpx.HTTPError as exc:
        raise unreachable(url, exc) from None
    said = refusal(url, response, key)
    if said is not None:
        raise CommandError(said)
    if response.status_code >= 400:
        raise CommandError(f"{url} answered {response.status_code}: {server_error(response)[1]}")
    return response
