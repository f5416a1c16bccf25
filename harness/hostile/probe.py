"""``/health`` sampled from a thread while a hostile case runs: it must keep answering."""

from __future__ import annotations

import threading
import time

import httpx

from harness.timing import percentile

GENEROUS_S = 2.0  # what "kept answering" means in a test; the bench measures the real figures


class HealthProbe:
    """Polls ``/health`` every ``interval_s`` on one kept-alive connection (opened before the
    case starts, as a monitoring client's would be) until the block ends, and for at least
    ``min_samples`` polls."""

    def __init__(
        self,
        url: str,
        interval_s: float = 0.01,
        min_samples: int = 10,
        max_samples: int = 100_000,
    ) -> None:
        self.url = url
        self.interval_s = interval_s
        self.min_samples = min_samples
        self.max_samples = max_samples
        self.samples: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=url, timeout=10)
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def _run(self) -> None:
        while len(self.samples) + len(self.failures) < self.max_samples:
            if self._stop.is_set() and len(self.samples) >= self.min_samples:
                break
            start = time.perf_counter()
            try:
                r = self._client.get("/health")
                if r.status_code != 200:
                    self.failures.append(f"HTTP {r.status_code}")
            except httpx.HTTPError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            else:
                self.samples.append(time.perf_counter() - start)
            time.sleep(self.interval_s)

    def __enter__(self) -> HealthProbe:
        self._client.get("/health")  # the connection exists before the case starts
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        self._client.close()

    @property
    def p50(self) -> float:
        return percentile(self.samples, 0.5) if self.samples else 0.0

    @property
    def p99(self) -> float:
        return percentile(self.samples, 0.99) if self.samples else 0.0

    @property
    def max(self) -> float:
        return max(self.samples, default=0.0)

    def assert_answered(self) -> None:
        """Every poll answered 200, and none took anywhere near a client's patience."""
        assert not self.failures, self.failures[:5]
        assert len(self.samples) >= self.min_samples
        assert self.max < GENEROUS_S, f"/health took {self.max:.3f} s"


class FreshProbe:
    """Asks ``path`` every ``interval_s`` on a new connection each time (as a kubelet's probe
    does) until the block ends: how many were asked, and the failures (status or error)."""

    def __init__(self, url: str, path: str = "/health", interval_s: float = 0.05) -> None:
        self.url = url
        self.path = path
        self.interval_s = interval_s
        self.asked = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fresh-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.asked += 1
            try:
                r = httpx.get(f"{self.url}{self.path}", timeout=10)
                if r.status_code != 200:
                    self.failures.append(f"HTTP {r.status_code} {r.text[:80]}")
            except httpx.HTTPError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.interval_s)

    def __enter__(self) -> FreshProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    @property
    def answered(self) -> int:
        return self.asked - len(self.failures)
