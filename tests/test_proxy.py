"""docs/proxy/: the nginx config and the Caddyfile the operating guide gives, run for real in front
of a real server (the bundled model, keys mode): TLS with a self-signed certificate made by
`openssl req` (plain HTTP where openssl is missing), streams arriving token by token through the
proxy, a whole answer, the x-request-id header, a body over the limit refused with 413, and the
client's address forwarded. Each proxy is skipped, saying why, where its binary is not installed
(Debian: `apt-get install nginx caddy`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from appliance.config.sections import ServerSettings
from tests.conftest import CHAT_MODEL, ROOT, Server, config_text, free_port, start_server, stop_server

PROXY_DIR = ROOT / "docs" / "proxy"
BODY_LIMIT = 1 << 20  # the test server's [server] max_body_bytes, and nginx's client_max_body_size as rendered
DEFAULT_LIMIT = ServerSettings().max_body_bytes


def binary(name: str) -> str | None:
    """On PATH, or in the sbin folders a non-root PATH leaves out (Debian puts nginx there)."""
    sbin = (Path("/usr/sbin") / name, Path("/usr/local/sbin") / name)
    return shutil.which(name) or next((str(p) for p in sbin if p.is_file()), None)


NGINX, CADDY, OPENSSL = binary("nginx"), binary("caddy"), binary("openssl")


def lan_address() -> str | None:
    """This machine's address on its network, where it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


LAN_ADDRESS = lan_address()


def swap(text: str, old: str, new: str) -> str:
    """`old` must be in the shipped file exactly once: an edit of the docs that this rendering
    no longer matches fails here rather than testing something else."""
    assert text.count(old) == 1, f"expected {old!r} once in the shipped config"
    return text.replace(old, new)


@dataclass(frozen=True)
class Tls:
    cert: Path
    key: Path


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls | None:
    """A self-signed certificate for 127.0.0.1 (and this machine's network address), or None
    (plain HTTP) without openssl."""
    if OPENSSL is None:
        return None
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    names = "IP:127.0.0.1,DNS:localhost" + (f",IP:{LAN_ADDRESS}" if LAN_ADDRESS else "")
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", f"subjectAltName={names}"], check=True, capture_output=True, timeout=60)
    return Tls(cert, key)


@dataclass(frozen=True)
class Appliance:
    server: Server
    key: str  # a member's


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    srv = start_server(tmp_path_factory.mktemp("proxied"),
                       config_text(embeddings=False, max_body_bytes=BODY_LIMIT, auth="keys"))
    try:
        made = subprocess.run([sys.executable, "-m", "appliance.cli.main", "keys", "create", "--tenant", "acme",
                               "--app", "chat", "--user", "bob", "--role", "member",
                               "--config", str(srv.home.parent / "models.toml")],
                              cwd=ROOT, env={**os.environ, "APPLIANCE_HOME": str(srv.home)},
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        yield Appliance(srv, made.stdout.strip().splitlines()[-1])
    finally:
        stop_server(srv)


def render_nginx(port: int, upstream: int, redirect_port: int, tls: Tls | None) -> str:
    text = (PROXY_DIR / "nginx.conf").read_text()
    text = swap(text, "server 127.0.0.1:8080;", f"server 127.0.0.1:{upstream};")
    text = swap(text, "listen 80;", f"listen 127.0.0.1:{redirect_port};")
    text = swap(text, "client_max_body_size 4m;", f"client_max_body_size {BODY_LIMIT // 1024}k;")
    lan = f"\n    listen {LAN_ADDRESS}:{port}{' ssl' if tls else ''};" if LAN_ADDRESS else ""
    if tls is not None:
        text = swap(text, "listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;{lan}")
        text = swap(text, "/etc/ssl/appliance/fullchain.pem", str(tls.cert))
        text = swap(text, "/etc/ssl/appliance/privkey.pem", str(tls.key))
    else:
        text = swap(text, "listen 443 ssl;", f"listen 127.0.0.1:{port};{lan}")
        text = "\n".join(line for line in text.splitlines() if not line.strip().startswith("ssl_"))
    return text


def render_caddy(port: int, upstream: int, redirect_port: int, tls: Tls | None, folder: Path) -> str:
    text = (PROXY_DIR / "Caddyfile").read_text()
    text = swap(text, "reverse_proxy 127.0.0.1:8080 {", f"reverse_proxy 127.0.0.1:{upstream} {{")
    scheme = "https" if tls else "http"
    names = ", ".join(f"{scheme}://{host}:{port}" for host in ("127.0.0.1", LAN_ADDRESS) if host)
    site = f"{names} {{" + (f"\n\ttls {tls.cert} {tls.key}" if tls else "")
    text = swap(text, "llm.example.com {", site)
    # Ports of the test's own, no admin endpoint, state in the test's folder: the site itself is the shipped one.
    http_port, https_port = (redirect_port, port) if tls else (port, redirect_port)
    options = (f"{{\n\tadmin off\n\thttp_port {http_port}\n\thttps_port {https_port}\n"
               f"\tstorage file_system {folder / 'data'}\n}}\n\n")
    return options + text


def caddy_env(folder: Path) -> dict[str, str]:
    return {**os.environ, "HOME": str(folder), "XDG_DATA_HOME": str(folder / "data"),
            "XDG_CONFIG_HOME": str(folder / "config")}


@dataclass
class Proxy:
    name: str
    base_url: str
    verify: ssl.SSLContext | bool  # trusts the test's certificate
    log: Path
    redirect_url: str  # where plain HTTP is answered with a redirect to https
    key: str
    lan_url: str | None  # the same proxy on this machine's network address

    def http(self, key: str | None = None, base_url: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=base_url or self.base_url, verify=self.verify, timeout=120,
                            headers={"Authorization": f"Bearer {key or self.key}"})

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.key, max_retries=0,
                             http_client=httpx.Client(verify=self.verify, timeout=120))


def wait_ready(proxy: Proxy, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{proxy.name} exited with {process.returncode}:\n{proxy.log.read_text()}")
        try:
            with proxy.http() as client:
                if client.get("/health").status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{proxy.name} did not pass /health on:\n{proxy.log.read_text()}")


@pytest.fixture(scope="module", params=["nginx", "caddy"])
def proxy(request: pytest.FixtureRequest, appliance: Appliance, tls: Tls | None,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    name = request.param
    exe = NGINX if name == "nginx" else CADDY
    if exe is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install {name}); docs/proxy/ is unchecked against it")
    folder = tmp_path_factory.mktemp(name)
    port, redirect_port, upstream = free_port(), free_port(), int(appliance.server.base_url.rsplit(":", 1)[1])
    scheme = "https" if tls else "http"
    proxy_ = Proxy(name, f"{scheme}://127.0.0.1:{port}", ssl.create_default_context(cafile=tls.cert) if tls else False,
                   folder / "proxy.log", f"http://127.0.0.1:{redirect_port}", appliance.key,
                   f"{scheme}://{LAN_ADDRESS}:{port}" if LAN_ADDRESS else None)
    if name == "nginx":
        site = folder / "appliance.conf"
        site.write_text(render_nginx(port, upstream, redirect_port, tls))
        kinds = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        temp = "\n".join(f"    {kind}_temp_path {folder / kind};" for kind in kinds)
        main = folder / "nginx.conf"
        main.write_text(
            # As root, the workers would run as nobody, who cannot write bodies into the test's folder.
            ("user root;\n" if os.geteuid() == 0 else "")
            + f"daemon off;\nworker_processes 1;\npid {folder / 'nginx.pid'};\nerror_log {proxy_.log} info;\n"
            f"events {{ worker_connections 256; }}\n"
            f"http {{\n    access_log {folder / 'access.log'};\n{temp}\n    include {site};\n}}\n")
        command = [exe, "-p", str(folder), "-c", str(main), "-e", str(proxy_.log)]
        checked = subprocess.run([*command, "-t"], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        env = dict(os.environ)
    else:
        caddyfile = folder / "Caddyfile"
        caddyfile.write_text(render_caddy(port, upstream, redirect_port, tls, folder))
        command = [exe, "run", "--config", str(caddyfile), "--adapter", "caddyfile"]
        env = caddy_env(folder)
    with proxy_.log.open("ab") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(proxy_, process)
        yield proxy_
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- the shipped files ----------------------------------------------------------------------------


def test_nginx_takes_the_bodies_the_server_takes_by_default() -> None:
    """nginx reads a whole body before passing it on and refuses past client_max_body_size (1m
    unless set); Caddy streams the body and leaves the limit to the server."""
    assert DEFAULT_LIMIT == 4 << 20
    assert "client_max_body_size 4m;" in (PROXY_DIR / "nginx.conf").read_text()


def test_the_operating_guide_shows_the_shipped_files() -> None:
    guide = (ROOT / "docs" / "operating.md").read_text()
    for name in ("nginx.conf", "Caddyfile"):
        assert (PROXY_DIR / name).read_text().strip() in guide, f"docs/operating.md no longer shows docs/proxy/{name}"


def test_caddy_validates_the_shipped_caddyfile(tmp_path: Path) -> None:
    if CADDY is None:
        pytest.skip("caddy is not installed (Debian: apt-get install caddy); docs/proxy/Caddyfile is unchecked")
    done = subprocess.run([CADDY, "validate", "--config", str(PROXY_DIR / "Caddyfile"), "--adapter", "caddyfile"],
                          env=caddy_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Valid configuration" in done.stdout + done.stderr


# -- through the proxy ----------------------------------------------------------------------------

STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to fly over the sea."}]


@dataclass(frozen=True)
class Arrival:
    at: float
    events: int  # stream events (SSE data lines or NDJSON lines) completed by this read


def read_stream(proxy: Proxy, path: str, body: dict, events_in: Callable[[str], int]) -> tuple[float, list[Arrival], str]:
    """When the request left, each network read of the streamed answer with the time it arrived,
    and the whole text."""
    arrivals: list[Arrival] = []
    text = ""
    with proxy.http() as client:
        started = time.monotonic()
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200, response.read()
            for raw in response.iter_raw():
                before = events_in(text)
                text += raw.decode()
                arrivals.append(Arrival(time.monotonic(), events_in(text) - before))
    return started, arrivals, text


def sse_events(text: str) -> int:
    return text.count("\n\n")


def ndjson_events(text: str) -> int:
    return text.count("\n")


STREAMS = {
    "sse": ("/v1/chat/completions",
            {"model": CHAT_MODEL, "messages": STORY, "max_tokens": 48, "temperature": 0, "stream": True}, sse_events),
    "ndjson": ("/api/chat",
               {"model": CHAT_MODEL, "messages": STORY, "stream": True, "options": {"num_predict": 48, "temperature": 0}},
               ndjson_events),
}


@pytest.mark.parametrize("kind", list(STREAMS))
def test_a_stream_arrives_token_by_token_not_buffered_into_one(proxy: Proxy, kind: str) -> None:
    path, body, events_in = STREAMS[kind]
    started, arrivals, text = read_stream(proxy, path, body, events_in)
    with_events = [a for a in arrivals if a.events]
    total = sum(a.events for a in arrivals)
    assert total >= 10, text  # the model wrote a story, one event a token
    # A buffering proxy hands the stream over in one read or a few, all at the end.
    assert len(with_events) >= total // 2, [(round(a.at - started, 3), a.events) for a in arrivals]
    first, last = with_events[0].at, with_events[-1].at
    assert last - first >= 0.3 * (last - started), (first - started, last - started)
    if kind == "sse":
        assert text.rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(text.strip().splitlines()[-1])["done"] is True


def test_a_whole_answer_comes_back_with_its_request_id(proxy: Proxy) -> None:
    raw = proxy.openai().chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=16, temperature=0)
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert raw.headers["x-request-id"] == completion.id  # the call's own id, passed through
    assert raw.headers["x-trace-id"]


def test_a_body_over_the_limit_is_413_and_one_under_it_reaches_the_server(proxy: Proxy) -> None:
    def body_of(size: int) -> bytes:
        head = json.dumps({"model": CHAT_MODEL, "messages": [{"role": "user", "content": ""}]}).encode()
        return head.replace(b'"content": ""', b'"content": "' + b"a" * (size - len(head)) + b'"')

    json_body = {"content-type": "application/json"}
    with proxy.http() as client:
        over = client.post("/v1/chat/completions", content=body_of(BODY_LIMIT + 4096), headers=json_body)
        assert over.status_code == 413, over.text
        if proxy.name == "caddy":  # the server's own refusal, streamed through; nginx answers its own page
            assert over.json()["error"]["code"] == "request_too_large"
        # Past nginx's in-memory body buffer, well under the limit: the server answers (the prompt is too long).
        under = client.post("/v1/chat/completions", content=body_of(BODY_LIMIT // 4), headers=json_body)
        assert under.status_code == 400, under.text
        assert under.json()["error"]["code"] == "context_length_exceeded"
        assert under.headers["x-request-id"]


def test_plain_http_is_redirected_to_https(proxy: Proxy, tls: Tls | None) -> None:
    if tls is None:
        pytest.skip("no openssl: the proxies run plain HTTP")
    with httpx.Client(timeout=10) as client:
        answer = client.get(f"{proxy.redirect_url}/v1/models")
    assert answer.status_code in (301, 308), answer.text  # nginx: 301; Caddy's automatic redirect: 308
    assert answer.headers["location"].startswith("https://127.0.0.1")


def test_the_clients_address_is_forwarded_to_the_server(proxy: Proxy, appliance: Appliance) -> None:
    """uvicorn takes X-Forwarded-For from a proxy on loopback: a key refused through the proxy is
    logged with the address the client came from, not the proxy's 127.0.0.1."""
    if proxy.lan_url is None or LAN_ADDRESS is None:
        pytest.skip("this machine has no address but loopback to come from")
    with proxy.http(key="apl-not-a-key", base_url=proxy.lan_url) as client:
        refused = client.get("/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    deadline = time.monotonic() + 10
    while f"refused a request to /v1/models from {LAN_ADDRESS}:" not in appliance.server.log.read_text():
        assert time.monotonic() < deadline, appliance.server.log.read_text()[-2000:]
        time.sleep(0.1)
