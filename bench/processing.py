"""Checkpoint read + CUTLASS processing throughput against a plain safetensors load.

For the qwen2.5-0.5b demo shape, from the page cache, on the CPU: ``safetensors.torch.load_file``
of every file with each tensor copied into memory the process owns (``load_file`` alone only maps
the file; the copy is the read) versus ``Checkpoint.open`` + ``plan_model`` + ``load_processed``
(read, validate, fuse, requantize, transpose, pad). Prints GB/s of checkpoint bytes for both and
their ratio.
"""

from __future__ import annotations

import argparse

from safetensors.torch import load_file

from bench.common import demo_checkpoint, median_seconds, warm_page_cache
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing import load_processed, plan_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--scheme", default="fp8", choices=["fp8", "fp8-pc-pt"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    path = demo_checkpoint(args.shape, args.scheme)
    size = warm_page_cache(path)
    files = sorted(path.glob("*.safetensors"))

    def plain() -> None:
        for f in files:
            for tensor in load_file(str(f)).values():
                tensor.clone()

    def processed() -> None:
        with Checkpoint.open(path) as ckpt:
            load_processed(ckpt, plan_model(ckpt))

    plain_s, _ = median_seconds(plain, args.repeats)
    proc_s, _ = median_seconds(processed, args.repeats)
    gb = size / 1e9
    print(f"checkpoint: {args.shape} {args.scheme}, {gb:.3f} GB, median of {args.repeats}")
    print(f"safetensors load_file        : {plain_s * 1e3:8.1f} ms  {gb / plain_s:6.2f} GB/s")
    print(f"read + process for CUTLASS   : {proc_s * 1e3:8.1f} ms  {gb / proc_s:6.2f} GB/s")
    print(f"ratio (processing / plain)   : {plain_s / proc_s:6.2f}x the throughput of load_file")


if __name__ == "__main__":
    main()
