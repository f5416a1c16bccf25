"""The daemon's first load of a model from the page cache, against the loaders it competes with.

One run, one checkpoint (a demo checkpoint of ``--shape``, written under ``--dir`` if missing),
page cache warmed first; every figure is GB/s of checkpoint bytes and a ratio to the daemon:

1. the daemon's load: ``load_model`` (the daemon's own code: open, plan, allocate the arena,
   read + check + process + checksum, manifest) into a CUDA arena or a shared-memory arena;
   the first load of the process and the median of ``--repeats``;
2. ``safetensors.load_file`` + ``.to(device)`` (``.clone()`` on the CPU) alone, and with the
   same processing done in torch on the device (the same code maps, so the same bytes: the run
   checks that they are);
3. vLLM's default loader (``vllm.LLM(load_format="auto")`` in a fresh process, its own "Model
   loading took X GiB memory and Y seconds" line), when vLLM is importable there; skipped with a
   message otherwise;
4. two loads at once against one after the other, on the shared loading pool.

``python -m bench.cold_load --shape llama-8b --device cuda`` prints everything; ``--json`` also
writes the figures (rewritten after each step, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import CACHE, save_json, shm_scratch, warm_page_cache
from bench.daemon_loads import daemon_load, pair_of_loads, release
from bench.measure import cpu_seconds, log, sync, timed
from bench.plain_load import plain_process, plain_read, same_bytes
from bench.vllm_default_load import vllm_load
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.plan import plan_model
from modelopt_fp8.schemes import demo_schemes
from service.demo import SHAPES, write_demo_checkpoint


def checkpoint(directory: Path, shape: str, scheme: str) -> Path:
    path = directory / f"{shape}-{scheme}"
    if not (path / "config.json").is_file():
        log(f"writing the {shape} {scheme} demo checkpoint to {path} (once) ...")
        start = time.perf_counter()
        write_demo_checkpoint(path, scheme, shape)
        log(f"  written in {time.perf_counter() - start:.0f} s")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--scheme", default="fp8", choices=sorted(demo_schemes()))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", type=Path, default=CACHE, help="where demo checkpoints live")
    parser.add_argument("--repeats", type=int, default=3, help="daemon loads after the first")
    parser.add_argument("--vllm-site", help="a directory holding vllm/ to put on PYTHONPATH")
    parser.add_argument("--vllm-timeout", type=float, default=420.0)
    parser.add_argument("--vllm-memory", type=float, default=0.5, help="gpu_memory_utilization")
    parser.add_argument("--skip", nargs="*", default=[], choices=["plain", "vllm", "pair"])
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="loading threads (the daemon's default: cores - 1)",
    )
    parser.add_argument("--pair-repeats", type=int, default=3, help="runs of each pair timing")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # as `weight-cache serve` does: sizes the loading pool
    sys.setswitchinterval(0.001)

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.ones(1, device=device).add_(1)  # the context and a first kernel: not a load
        sync(device)
    path = checkpoint(args.dir, args.shape, args.scheme)
    size = warm_page_cache(path)
    gb = size / 1e9
    result: dict[str, Any] = {
        "shape": args.shape,
        "scheme": args.scheme,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "checkpoint_bytes": size,
        "cores": os.cpu_count(),
        "loading_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }

    def save() -> None:
        save_json(args.json, result)

    log(f"{args.shape} {args.scheme}: {gb:.2f} GB at {path}, device {result['device_name']}")
    shm = shm_scratch()
    try:
        times = []
        cpu: list[float] = []
        for i in range(1 + args.repeats):
            cpu_start = cpu_seconds()
            seconds, ranks = timed(lambda: daemon_load(path, device, shm, "bench"))
            cpu.append(cpu_seconds() - cpu_start)
            times.append(seconds)
            label = "first" if i == 0 else f"again {i}"
            log(f"  daemon load ({label}): {seconds:.3f} s  {gb / seconds:.2f} GB/s")
            if i < args.repeats:
                release(ranks)
        first, median = times[0], statistics.median(times[1:] or times)
        result["daemon"] = {
            "first_s": first,
            "median_s": median,
            "all_s": times,
            # CPU time (all threads) per GB: what the load costs the host's cores, which a
            # machine shared with other work does not distort the way it distorts wall time.
            "cpu_s_per_gb": statistics.median(cpu[1:] or cpu) / gb,
        }
        save()

        if "plain" not in args.skip:
            with Checkpoint.open(path) as ckpt:
                plan = plan_model(ckpt)
            read_s, tensors = timed(lambda: plain_read(path, device))
            proc_s, storages = timed(lambda: plain_process(plan, tensors, device))
            identical = same_bytes(ranks, plan, storages)
            del tensors, storages
            result["plain"] = {"read_s": read_s, "process_s": proc_s, "identical": identical}
            log(f"  load_file + .to(device): {read_s:.3f} s; + processing: {proc_s:.3f} s more")
            save()
        release(ranks)

        if "pair" not in args.skip:
            log("two loads at once against one after the other ...")
            result["pair"] = pair_of_loads(path, device, shm, args.pair_repeats)
            save()

        if "vllm" not in args.skip:
            if device.type == "cuda":
                result["vllm"] = vllm_load(
                    path, args.vllm_site, args.vllm_timeout, args.vllm_memory
                )
            else:
                result["vllm"] = {"skipped": "vLLM's loader is compared on a GPU only"}
            save()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    report(result, gb)
    save()


def report(result: dict[str, Any], gb: float) -> None:
    daemon = result["daemon"]
    first, median = daemon["first_s"], daemon["median_s"]
    log("")
    log(
        f"{result['shape']} {result['scheme']} ({gb:.2f} GB) on {result['device_name']}, "
        f"{result['cores']} cores, {result['loading_threads']} loading threads, page cache warm"
    )
    log("(÷: a loader's time over the daemon's; above 1.00x the daemon is that much faster)")
    log(f"{'loader':<44}{'seconds':>9}{'GB/s':>8}{'÷ daemon first':>16}{'÷ median':>10}")

    def row(name: str, seconds: float) -> None:
        log(
            f"{name:<44}{seconds:>9.3f}{gb / seconds:>8.2f}{seconds / first:>15.2f}x"
            f"{seconds / median:>9.2f}x"
        )

    row("daemon load, first", first)
    row(f"daemon load, median of {len(daemon['all_s']) - 1 or 1}", median)
    per_gb = daemon["cpu_s_per_gb"]
    log(
        f"  daemon load CPU time: {per_gb:.2f} core-s per GB; {result['loading_threads']} loading "
        f"threads on free cores: at most {result['loading_threads'] / per_gb:.2f} GB/s"
    )
    plain = result.get("plain")
    if plain:
        row("load_file + .to(device)", plain["read_s"])
        row("load_file + .to(device) + processing", plain["read_s"] + plain["process_s"])
        log(f"  same bytes as the daemon's arena: {plain['identical']}")
    vllm = result.get("vllm")
    if vllm:
        if "seconds" in vllm:
            row("vLLM default loader ('Model loading took')", vllm["seconds"])
        else:
            log(f"vLLM default loader: {vllm.get('skipped') or vllm.get('error')}")
            if vllm.get("tail"):
                log(vllm["tail"])
    pair = result.get("pair")
    if pair:
        log(
            f"two loads (medians of {len(pair['together_all_s'])}): one after the other "
            f"{pair['sequential_s']:.3f} s, at once {pair['together_s']:.3f} s "
            f"({pair['together_s'] / pair['sequential_s']:.2f} of sequential; at most 1.00 is fair)"
        )


if __name__ == "__main__":
    main()
