"""Engine-side cost of checkpoint identity at engine start, per tier.

For a demo checkpoint (default: the llama-8b shape, about 9 GB) from the page cache: the
``sampled`` digest alone (headers in hand), ``checkpoint_fingerprint`` at each cheap tier (reading
what it needs from the files), and ``Expectations.for_checkpoint`` as an engine calls it (open the
checkpoint, read its configs and headers, digest) beside ``Checkpoint.open`` alone (what an
engine paid before any tier), medians of ``--repeats``; then the ``full`` tier once (every
byte). Target for the default (sampled) tier: at most 20 ms.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import demo_checkpoint, median_seconds, warm_page_cache
from engine_client.verify import Expectations
from modelopt_fp8.checkpoint import Checkpoint, IdentityTier, checkpoint_fingerprint
from modelopt_fp8.checkpoint.fingerprint import sampled_digest
from modelopt_fp8.schemes import demo_schemes

TARGET_MS = 20.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--scheme", default="fp8", choices=sorted(demo_schemes()))
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()

    path = demo_checkpoint(args.shape, args.scheme)
    size = warm_page_cache(path)
    with Checkpoint.open(path) as ckpt:
        files, tensors, headers = ckpt.files, len(ckpt.tensors), dict(ckpt._headers)
    cpu = torch.device("cpu")

    rows = {
        "sampled digest (headers in hand)": lambda: sampled_digest(path, files, headers),
        "fingerprint, tier files": lambda: checkpoint_fingerprint(path, IdentityTier.files),
        "fingerprint, tier sampled": lambda: checkpoint_fingerprint(path, IdentityTier.sampled),
        "fingerprint, tier hf_blob": lambda: checkpoint_fingerprint(path, IdentityTier.hf_blob),
        "Checkpoint.open (no digest)": lambda: Checkpoint.open(path).close(),
        "Expectations.for_checkpoint": lambda: Expectations.for_checkpoint(path, cpu),
    }
    print(
        f"checkpoint: {args.shape} {args.scheme}, {size / 1e9:.2f} GB, {len(files)} files, "
        f"{tensors} tensors; page cache; median of {args.repeats}"
    )
    results = {}
    for label, fn in rows.items():
        fn()  # first call outside the timing (imports, dentry cache)
        seconds, times = median_seconds(fn, args.repeats)
        results[label] = seconds
        print(f"{label:36s}: {seconds * 1e3:8.2f} ms  (min {min(times) * 1e3:.2f} ms)")
    start = time.perf_counter()
    checkpoint_fingerprint(path, IdentityTier.full)
    full_s = time.perf_counter() - start
    rate = size / 1e9 / full_s
    print(f"{'fingerprint, tier full (once)':36s}: {full_s * 1e3:8.0f} ms  {rate:.2f} GB/s")
    tier_ms = results["fingerprint, tier sampled"] * 1e3
    verdict = "met" if tier_ms <= TARGET_MS else "NOT met"
    print(f"default tier at engine start: {tier_ms:.2f} ms (target <= {TARGET_MS} ms: {verdict})")


if __name__ == "__main__":
    main()
