"""The guarded HTTP front subclasses uvicorn's internal httptools protocol: these tests fail on
any uvicorn but the one it was written against, and name the internals it relies on, so an
upgrade is a decision (re-read ``HttpToolsProtocol``, move ``UVICORN_VERSION``), never an
accident."""

from __future__ import annotations

import inspect

import httptools
import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl

from service.api.front.limits import FrontLimits
from service.api.front.uvicorn_protocol import UVICORN_VERSION, Front, protocol_for

# What GuardedHttpToolsProtocol overrides or calls, and what it reads.
OVERRIDDEN = (
    "connection_made",
    "connection_lost",
    "data_received",
    "send_400_response",
    "on_message_begin",
    "on_header",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "pause_writing",
    "resume_writing",
    "timeout_keep_alive_handler",
)
STATE = (
    "connections",
    "pipeline",
    "cycle",
    "flow",
    "transport",
    "loop",
    "scope",
    "headers",
    "parser",
    "client",
    "server",
)
CYCLE_STATE = (
    "response_started",
    "response_complete",
    "more_body",
    "disconnected",
    "message_event",
)
# Called, not overridden: the keep-alive timer a lingering connection stops.
CALLED = ("_unset_keepalive_if_required",)


def test_uvicorn_is_the_pinned_version() -> None:
    assert uvicorn.__version__ == UVICORN_VERSION, (
        f"uvicorn {uvicorn.__version__} is installed; service/api/front/uvicorn_protocol.py "
        "subclasses the "
        f"HttpToolsProtocol of uvicorn {UVICORN_VERSION}: re-read it and move the pin"
    )


def test_the_internals_the_front_relies_on_are_there() -> None:
    protocol = httptools_impl.HttpToolsProtocol
    for name in OVERRIDDEN + CALLED:
        assert callable(getattr(protocol, name, None)), name
    init = inspect.getsource(protocol.__init__)
    for name in STATE:
        assert f"self.{name} " in init or f"self.{name}:" in init, name
    cycle = inspect.getsource(httptools_impl.RequestResponseCycle.__init__)
    for name in CYCLE_STATE:
        assert f"self.{name} = " in cycle, name
    assert {"pause_writing", "resume_writing", "pause_reading"} <= set(dir(FlowControl))


def test_httptools_reports_chunk_headers() -> None:
    """Chunk headers are counted through httptools' public ``on_chunk_header`` callback."""

    class Seen:
        chunks = 0

        def on_chunk_header(self) -> None:
            self.chunks += 1

    seen = Seen()
    parser = httptools.HttpRequestParser(seen)
    parser.feed_data(
        b"POST / HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
    )
    assert seen.chunks == 3  # two chunks and the last, empty one


def test_the_guarded_class_overrides_only_what_it_names() -> None:
    guarded = protocol_for(Front(FrontLimits(8, 1024, 1.0, 2)))
    base = httptools_impl.HttpToolsProtocol
    own = {
        name
        for name, value in vars(guarded.__mro__[1]).items()
        if callable(value) and not name.startswith("_") and hasattr(base, name)
    }
    assert own == set(OVERRIDDEN)


def test_httptools_takes_pieces_and_reports_trailers_as_headers() -> None:
    """The front feeds the parser slices of a memoryview, counts header and trailer lines
    through ``on_header``, and reads a request's path with ``httptools.parse_url``."""

    class Seen:
        lines = 0
        body = b""
        done = False

        def on_header(self, name: bytes, value: bytes) -> None:
            self.lines += 1

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            self.done = True

    seen = Seen()
    parser = httptools.HttpRequestParser(seen)
    data = memoryview(
        b"POST /health?x=1 HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b"2\r\nab\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    for start in range(0, len(data), 7):
        parser.feed_data(data[start : start + 7])
    assert seen.done and seen.body == b"ab"
    assert seen.lines == 3  # two headers and the trailer
    assert httptools.parse_url(b"/health?x=1").path == b"/health"
