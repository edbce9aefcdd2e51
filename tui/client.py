"""The admin HTTP API, as the TUI uses it: the same endpoints scripts use, so it works against a
remote appliance too."""

from __future__ import annotations

from typing import Any

import httpx

# A load waits for the weights (and for room under the memory budget), an add hashes the file: far
# longer than a poll may take.
FLEET_TIMEOUT_S = 600.0


class AdminClient:
    def __init__(self, base_url: str, key: str | None, timeout: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self._checked(method, path, **kwargs)).json()

    async def _checked(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except Exception:
                message = response.text[:200]
            raise AdminError(response.status_code, message)
        return response

    async def health(self) -> dict[str, Any]:
        return await self._json("GET", "/health")

    async def metrics(self) -> str:
        # A refused key is an AdminError like any other route's, never "unreachable".
        return (await self._checked("GET", "/metrics")).text

    async def budgets(self) -> dict[str, Any]:
        return await self._json("GET", "/admin/budgets")

    async def set_budget(self, level: str, name: str, usd: float, period: str) -> dict[str, Any]:
        return await self._json("PUT", "/admin/budgets", json={"level": level, "name": name, "usd": usd, "period": period})

    async def cache(self) -> dict[str, Any]:
        return await self._json("GET", "/admin/cache")

    async def cache_entries(self, text: str) -> dict[str, Any]:
        return await self._json("GET", "/admin/cache/entries", params={"q": text})

    async def mark_entry(self, entry_id: int, state: str) -> dict[str, Any]:
        return await self._json("POST", f"/admin/cache/entries/{entry_id}", json={"state": state})

    async def invalidate(self, **which: str) -> dict[str, Any]:
        return await self._json("POST", "/admin/cache/invalidate", json=which)

    async def keys(self) -> dict[str, Any]:
        return await self._json("GET", "/admin/keys")

    async def create_key(self, tenant: str, app: str, user: str, role: str) -> dict[str, Any]:
        return await self._json("POST", "/admin/keys", json={"tenant": tenant, "app": app, "user": user, "role": role})

    async def revoke_key(self, key_id: str) -> dict[str, Any]:
        return await self._json("DELETE", f"/admin/keys/{key_id}")

    async def traces(self, limit: int = 100) -> dict[str, Any]:
        return await self._json("GET", "/admin/traces", params={"limit": limit})

    async def trace(self, trace_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/admin/traces/{trace_id}")

    async def models(self) -> dict[str, Any]:
        return await self._json("GET", "/admin/models")

    async def jobs(self) -> dict[str, Any]:
        return await self._json("GET", "/admin/jobs")

    async def loaded_models(self) -> dict[str, Any]:
        return await self._json("GET", "/admin/models/loaded")

    async def load_model(self, alias: str) -> dict[str, Any]:
        return await self._json("POST", f"/admin/models/{alias}/load", timeout=FLEET_TIMEOUT_S)

    async def unload_model(self, alias: str) -> dict[str, Any]:
        return await self._json("POST", f"/admin/models/{alias}/unload")

    async def add_model(self, path: str, alias: str | None = None, like: str | None = None) -> dict[str, Any]:
        body = {"path": path, **({"alias": alias} if alias else {}), **({"like": like} if like else {})}
        return await self._json("POST", "/admin/models", json=body, timeout=FLEET_TIMEOUT_S)

    async def remove_model(self, alias: str) -> dict[str, Any]:
        return await self._json("DELETE", f"/admin/models/{alias}", timeout=FLEET_TIMEOUT_S)

    async def load_adapter(self, alias: str, name: str, path: str, scale: float = 1.0) -> dict[str, Any]:
        return await self._json("PUT", f"/admin/models/{alias}/adapters/{name}", json={"path": path, "scale": scale})

    async def unload_adapter(self, alias: str, name: str) -> dict[str, Any]:
        return await self._json("DELETE", f"/admin/models/{alias}/adapters/{name}")

    async def quantize(self, source: str, type_name: str, allow_requantize: bool = False) -> dict[str, Any]:
        return await self._json("POST", "/admin/models/quantize", json={"source": source, "type": type_name, "allow_requantize": allow_requantize})

    async def pull(self, repo: str, file: str) -> dict[str, Any]:
        return await self._json("POST", "/admin/models/pull", json={"repo": repo, "file": file})

    async def train(self, student: str, data: str, name: str | None = None, start_at: str | None = None) -> dict[str, Any]:
        body = {"student": student, "data": data} | ({"name": name} if name else {}) | ({"start_at": start_at} if start_at else {})
        return await self._json("POST", "/admin/distill/train", json=body)

    async def stop_job(self, job_id: str) -> dict[str, Any]:
        return await self._json("DELETE", f"/admin/jobs/{job_id}")

    async def close(self) -> None:
        await self._http.aclose()


class AdminError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message
