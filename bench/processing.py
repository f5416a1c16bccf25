"""Checkpoint read + CUTLASS processing throughput against a plain safetensors load, on the CPU.

For a demo shape (default qwen2.5-0.5b), from the page cache, all in one run:

* ``safetensors.torch.load_file`` of every file with each tensor copied into memory the process
  owns (``load_file`` alone only maps the file; the copy is the read);
* the same, then the processing in plain torch (``bench/plain_load.py``): what a loader without
  the fast path does for the same bytes (the run checks that they are the same);
* ``process_checkpoint``: read, validate, fuse, requantize, transpose, pad into fresh tensors;
* the daemon's ``load_model`` into a shared-memory arena (with checksums and manifest).

Prints GB/s of checkpoint bytes and the ratio of each to ``load_file``.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
from safetensors.torch import load_file

from bench.common import demo_checkpoint, median_seconds, shm_scratch, warm_page_cache
from bench.daemon_loads import daemon_load, release
from bench.plain_load import plain_process, plain_read
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.plan import plan_model
from modelopt_fp8.schemes import demo_schemes
from service.registry.loader import ResidentRank


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--scheme", default="fp8", choices=sorted(demo_schemes()))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="loading threads (all cores)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = demo_checkpoint(args.shape, args.scheme)
    size = warm_page_cache(path)
    files = sorted(path.glob("*.safetensors"))

    # Each returns what it made; the timer frees it after the clock stops.
    def plain() -> list[torch.Tensor]:
        return [t.clone() for f in files for t in load_file(str(f)).values()]

    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt)
        fast = process_checkpoint(ckpt, plan)
    cpu = torch.device("cpu")

    def plain_processed() -> dict[str, torch.Tensor]:
        return plain_process(plan, plain_read(path, cpu), cpu)

    specs = {spec.name: spec for spec in plan.specs}
    same = all(
        torch.equal(_bytes(specs[name].storage_of(fast[name])), _bytes(theirs))
        for name, theirs in plain_processed().items()
    )
    del fast

    def processed() -> dict[str, torch.Tensor]:
        with Checkpoint.open(path) as ckpt:
            return process_checkpoint(ckpt, plan_model(ckpt))

    shm = shm_scratch()

    def arena() -> list[ResidentRank]:
        return daemon_load(path, torch.device("cpu"), shm, "bench")

    try:
        rows = [("safetensors load_file + copy", median_seconds(plain, args.repeats)[0])]
        rows.append(
            ("load_file + plain torch processing", median_seconds(plain_processed, args.repeats)[0])
        )
        processed_s = median_seconds(processed, args.repeats)[0]
        rows.append(("read + process (process_checkpoint)", processed_s))
        rows.append(
            ("daemon load into a shm arena", median_seconds(arena, args.repeats, release)[0])
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    gb = size / 1e9
    plain_s = rows[0][1]
    print(
        f"checkpoint: {args.shape} {args.scheme}, {gb:.3f} GB, {args.threads} loading threads, "
        f"median of {args.repeats}; plain processing gives the same bytes: {same}"
    )
    for name, seconds in rows:
        print(
            f"{name:<34}: {seconds * 1e3:8.1f} ms  {gb / seconds:6.2f} GB/s  "
            f"{plain_s / seconds:5.2f}x the throughput of load_file"
        )


if __name__ == "__main__":
    main()
