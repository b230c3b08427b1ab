"""A minimal HTTP/1.1 client over asyncio streams for the load driver (standard library only).

Keep-alive connections, chunked / Content-Length / close-delimited bodies yielded as they arrive,
and a loopback-only target check.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024      # a response whose headers exceed this is an error
STREAM_LIMIT = 1 << 20            # asyncio.StreamReader line limit
READ_SIZE = 1 << 16               # bytes asked for per body read
MAX_CHUNK_LINE = 1024             # a chunk-size line longer than this is an error


class HttpError(Exception):
    """A malformed or truncated HTTP response."""


class ChunkedDecoder:
    """Incremental decoder of a Transfer-Encoding: chunked body (RFC 9112, section 7.1)."""

    def __init__(self):
        self.buf = b""
        self.done = False
        self.extra = False        # bytes arrived after the last chunk

    def feed(self, data: bytes) -> bytes:
        """Adds received bytes; returns the payload of every chunk they complete."""
        buf = self.buf + data if self.buf else data
        out = []
        pos = 0
        while not self.done:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    raise HttpError("chunk-size line too long")
                break
            try:
                size = int(buf[pos:eol].split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpError(f"bad chunk-size line {buf[pos:eol][:40]!r}") from None
            if size < 0:
                raise HttpError("negative chunk size")
            if size == 0:
                # Last chunk: optional trailer fields, then an empty line.
                if buf.startswith(b"\r\n", eol + 2):
                    pos = eol + 4
                elif (end := buf.find(b"\r\n\r\n", eol + 2)) >= 0:
                    pos = end + 4
                else:
                    break
                self.done = True
                self.extra = pos < len(buf)
                break
            start = eol + 2
            if len(buf) < start + size + 2:
                break
            if buf[start + size:start + size + 2] != b"\r\n":
                raise HttpError("chunk data not followed by CRLF")
            out.append(buf[start:start + size])
            pos = start + size + 2
        self.buf = buf[pos:]
        return b"".join(out)


@dataclass(frozen=True)
class Target:
    """A loopback HTTP endpoint (scheme http only)."""
    host: str
    port: int

    @staticmethod
    def parse(url: str) -> "Target":
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// targets are supported, got {url!r}")
        host = parts.hostname or ""
        port = parts.port or 80
        if not _is_loopback(host):
            raise ValueError(f"target {host!r} is not a loopback address; only 127.0.0.0/8, ::1 "
                             "and localhost may be load-tested")
        return Target(host, port)


def _is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


class ConnectionClosed(HttpError):
    """The server closed the connection before sending a response."""


class Connection:
    """One keep-alive HTTP/1.1 connection; reopened transparently when the server closes it."""

    def __init__(self, target: Target):
        self.target = target
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None
        self.n_requests = 0       # sent on the current socket

    async def ensure_open(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(
                self.target.host, self.target.port, limit=STREAM_LIMIT)
            self.n_requests = 0
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def send(self, method: str, path: str, body: bytes, accept: str) -> None:
        await self.ensure_open()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.target.host}:{self.target.port}\r\n"
                f"Content-Type: application/json\r\nAccept: {accept}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n")
        self.writer.write(head.encode("ascii") + body)
        self.n_requests += 1
        await self.writer.drain()

    async def request(self, method: str, path: str, body: bytes,
                      accept: str) -> tuple[int, dict[str, str]]:
        """Sends a request and reads the response head. A reused connection that turns out to be
        closed (servers may close after a response despite keep-alive; llama-server does after
        each stream) is replaced by a fresh one once, as curl does."""
        reused = self.writer is not None and not self.writer.is_closing() and self.n_requests > 0
        try:
            await self.send(method, path, body, accept)
            return await self.read_head()
        except (ConnectionClosed, ConnectionError):
            self.close()
            if not reused:
                raise
        await self.send(method, path, body, accept)
        return await self.read_head()

    async def read_head(self) -> tuple[int, dict[str, str]]:
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionClosed("connection closed before the response")
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpError(f"malformed status line {status_line[:80]!r}")
        headers: dict[str, str] = {}
        n_bytes = len(status_line)
        while True:
            line = await self.reader.readline()
            n_bytes += len(line)
            if n_bytes > MAX_HEADER_BYTES:
                raise HttpError("response headers too large")
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    async def body_chunks(self, headers: dict[str, str]):
        """Yields the body as it arrives (dechunked); leaves the connection reusable or closed."""
        keep = headers.get("connection", "").lower() != "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            # Decoded from raw reads, so that all chunks already received are handed over in one
            # piece (one wake-up per read, not three awaits per chunk: this keeps the driver cheap
            # at thousands of events per second).
            decoder = ChunkedDecoder()
            while True:
                data = await self.reader.read(READ_SIZE)
                if not data:
                    raise HttpError("connection closed inside a chunked body")
                payload = decoder.feed(data)
                if payload:
                    yield payload
                if decoder.done:
                    keep = keep and not decoder.extra   # nothing may follow (no pipelining)
                    break
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                data = await self.reader.read(min(left, READ_SIZE))
                if not data:
                    raise HttpError("connection closed inside the body")
                left -= len(data)
                yield data
        else:
            keep = False
            while data := await self.reader.read(READ_SIZE):
                yield data
        if not keep:
            self.close()

    async def call(self, method: str, path: str, payload: Optional[dict]) -> tuple[int, bytes]:
        """A plain request; returns (status, whole body)."""
        body = b"" if payload is None else json.dumps(payload).encode()
        status, headers = await self.request(method, path, body, "application/json")
        chunks = [c async for c in self.body_chunks(headers)]
        return status, b"".join(chunks)
