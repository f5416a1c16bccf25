"""What one request may spend on framing: the bytes that are not its body (the request line,
headers, chunk size lines and their CRLFs, chunk extensions, trailers).

Framing costs the daemon more than body bytes do: every header line and every chunk is a call
into Python. So a request gets ``max_header_bytes`` of it, and its body pays for the rest: each
chunk may add ``CHUNK_FRAMING_BYTES``, and past the first ``FREE_CHUNKS`` a body must carry on
average ``MIN_CHUNK_BYTES`` per chunk (a body of one-byte chunks is refused after 16 of them,
whoever sends it). Header and trailer lines are at most ``MAX_HEADER_LINES`` (Apache's default
``LimitRequestFields``). Bytes are counted as they arrive, so a trailer of gigabytes costs no
more than a header of them.
"""

from __future__ import annotations

from protocol.errors import ChunksTooSmallError, HeadersTooLargeError, WeightCacheError

CHUNK_FRAMING_BYTES = 24  # a chunk's size line and CRLFs, beside max_header_bytes
FREE_CHUNKS = 16  # chunks any body may use, however small
MIN_CHUNK_BYTES = 256  # past those, what each chunk must carry on average
MAX_HEADER_LINES = 100  # header and trailer lines of one request


class FramingBudget:
    """One connection's count of the current request's framing, and the bound it passed."""

    def __init__(self, max_header_bytes: int) -> None:
        self.max_header_bytes = max_header_bytes
        self.begin()

    def begin(self) -> None:
        """A new request: nothing spent yet."""
        self.framing = 0  # bytes arrived that the parser has not found to be body
        self.payload = 0  # body bytes
        self.chunks = 0
        self.lines = 0

    @property
    def started(self) -> bool:
        """Whether any byte of a request has come."""
        return bool(self.framing or self.payload)

    def arrived(self, nbytes: int) -> None:
        self.framing += nbytes  # the body's share is taken off as the parser finds it

    def body(self, nbytes: int) -> None:
        self.framing = max(0, self.framing - nbytes)
        self.payload += nbytes

    def chunk(self) -> None:
        self.chunks += 1

    def line(self) -> None:
        self.lines += 1

    def passed(self) -> WeightCacheError | None:
        """The bound this request has passed, as the refusal to answer; None within them."""
        if self.lines > MAX_HEADER_LINES:
            return HeadersTooLargeError(
                f"more than {MAX_HEADER_LINES} header and trailer lines",
                limit=MAX_HEADER_LINES,
            )
        if self.chunks > FREE_CHUNKS + self.payload // MIN_CHUNK_BYTES:
            return ChunksTooSmallError(
                f"{self.chunks} chunks carried {self.payload} bytes of body: past the first "
                f"{FREE_CHUNKS}, chunks must carry {MIN_CHUNK_BYTES} bytes on average",
                chunks=self.chunks,
                body_bytes=self.payload,
            )
        if self.framing > self.max_header_bytes + CHUNK_FRAMING_BYTES * self.chunks:
            return self.too_large()
        return None

    def too_large(self) -> HeadersTooLargeError:
        return HeadersTooLargeError(
            f"request line, headers and trailers exceed {self.max_header_bytes} bytes",
            limit=self.max_header_bytes,
        )
