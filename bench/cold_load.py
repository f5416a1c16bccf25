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
import importlib.util
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bench.common import CACHE, shm_scratch, warm_page_cache
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing import ModelPlan, plan_model
from modelopt_fp8.processing.execute import requantize_maps
from protocol.devices import Placement
from protocol.schemas.layout import Scheme
from protocol.schemas.manifest import DeviceKind
from service.demo import SHAPES, write_demo_checkpoint
from service.memory.shm import ArenaDir
from service.registry.loader import LoadRequest, Progress, ResidentRank, load_model

VLLM_LINE = re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) s")


def log(message: str) -> None:
    print(message, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checkpoint(directory: Path, shape: str, scheme: str) -> Path:
    path = directory / f"{shape}-{scheme}"
    if not (path / "config.json").is_file():
        log(f"writing the {shape} {scheme} demo checkpoint to {path} (once) ...")
        start = time.perf_counter()
        write_demo_checkpoint(path, scheme, shape)
        log(f"  written in {time.perf_counter() - start:.0f} s")
    return path


# --- 1. the daemon's load -----------------------------------------------------------------------


def daemon_load(path: Path, device: torch.device, shm: Path, model_id: str) -> list[ResidentRank]:
    placement = (
        Placement(DeviceKind.cuda, device.index or 0)
        if device.type == "cuda"
        else Placement(DeviceKind.cpu)
    )
    request = LoadRequest.unmanaged(model_id, path, [placement], ArenaDir.prepare(shm))
    return load_model(request, Progress())


def release(ranks: list[ResidentRank]) -> None:
    for rank in ranks:
        rank.arena.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


# --- 2. load_file + .to(device) + the same processing -------------------------------------------


def plain_read(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor on ``device`` (``load_file`` only maps the file: the copy to the
    device, or ``.clone()`` on the CPU, is the read)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            tensors[name] = tensor.to(device) if device.type == "cuda" else tensor.clone()
    sync(device)
    return tensors


def plain_process(
    plan: ModelPlan, tensors: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """The processing in plain torch on ``device``: slice, fuse, requantize (the same code
    maps, gathered on the device), pad; returns every storage."""
    out: dict[str, torch.Tensor] = {}
    for lp in plan.linears:
        parts = [
            tensors[s.weight][s.slice.rows[0] : s.slice.rows[1], s.slice.cols[0] : s.slice.cols[1]]
            for s in lp.shards
        ]
        scheme = lp.layout.scheme
        if scheme is Scheme.fp8:
            max_scale, maps = requantize_maps(
                [plan.scales[s.weight_scale or ""] for s in lp.shards]
            )
            for i, code_map in enumerate(maps):
                if code_map is None:
                    continue
                codes = parts[i].contiguous().view(torch.uint8)
                if device.type == "cuda":
                    table = torch.from_numpy(code_map.table).to(device)
                    parts[i] = table[codes.long()].view(parts[i].dtype)
                else:  # torch gathers bytes slowly on the CPU: NumPy, as the daemon does
                    mapped = torch.empty_like(codes)
                    code_map.apply(codes.numpy(), mapped.numpy())
                    parts[i] = mapped.view(parts[i].dtype)
            assert lp.weight_scale is not None and lp.input_scale is not None
            out[lp.weight_scale.name] = max_scale.to(device)
            inputs = [plan.scales[s.input_scale or ""].reshape(()) for s in lp.shards]
            out[lp.input_scale.name] = torch.stack(inputs).max().to(device)
        elif scheme is Scheme.fp8_pc_pt:
            assert lp.weight_scale is not None
            scale = torch.ones(lp.weight_scale.storage_shape, dtype=torch.float32, device=device)
            rows = [
                plan.scales[s.weight_scale or ""].reshape(-1)[s.slice.rows[0] : s.slice.rows[1]]
                for s in lp.shards
            ]
            joined = torch.cat(rows).to(device)
            scale[: joined.numel()] = joined
            out[lp.weight_scale.name] = scale
        fused = torch.cat(parts)
        weight = torch.zeros(lp.weight.storage_shape, dtype=lp.weight.dtype, device=device)
        weight[: fused.shape[0], : fused.shape[1]] = fused
        out[lp.weight.name] = weight
        if lp.bias is not None:
            biases = [tensors[s.bias or ""][s.slice.rows[0] : s.slice.rows[1]] for s in lp.shards]
            out[lp.bias.name] = torch.cat(biases)
    for cp in plan.carried:
        out[cp.spec.name] = tensors[cp.source]
    sync(device)
    return out


def same_bytes(
    ranks: list[ResidentRank], plan: ModelPlan, storages: dict[str, torch.Tensor]
) -> bool:
    arena = ranks[0].arena
    for spec in plan.specs:
        ours = arena.storage(spec).reshape(-1).view(torch.uint8)
        theirs = storages[spec.name].contiguous().reshape(-1).view(torch.uint8).to(ours.device)
        if not torch.equal(ours, theirs):
            log(f"  bytes differ: {spec.name}")
            return False
    return True


# --- 3. vLLM's default loader --------------------------------------------------------------------

VLLM_CODE = """
import sys, vllm
vllm.LLM(model=sys.argv[1], load_format="auto", enforce_eager=True, skip_tokenizer_init=True,
         gpu_memory_utilization=float(sys.argv[2]), max_model_len=1024, max_num_seqs=8, seed=0)
print("weight-cache bench: vLLM engine built", flush=True)
"""


def vllm_env(site: str | None) -> dict[str, str] | None:
    """The environment vLLM runs in: this one if it imports vllm, else ``site`` (or the H200
    recipe's /tmp/site) on PYTHONPATH if vllm is there; None when vLLM is nowhere."""
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_USE_FLASHINFER_SAMPLER=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK="1",
        PYTHONUNBUFFERED="1",
    )
    if site is None and importlib.util.find_spec("vllm") is not None:
        return env
    candidates = [site] if site else ["/tmp/site"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "vllm" / "__init__.py").is_file():
            env["PYTHONPATH"] = os.pathsep.join([candidate, os.getcwd()])
            return env
    return None


def vllm_load(path: Path, site: str | None, timeout_s: float, memory: float) -> dict[str, Any]:
    """vLLM's own figure for its default loader, read from its log as it comes; the engine is
    stopped once the line is there (the rest of its start-up is not a load)."""
    env = vllm_env(site)
    if env is None:
        return {"skipped": "vLLM is not importable here (give --vllm-site DIR holding vllm/)"}
    log("vLLM's default loader (fresh process, load_format='auto') ...")
    proc = subprocess.Popen(
        [sys.executable, "-c", VLLM_CODE, str(path), str(memory)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if VLLM_LINE.search("".join(lines[-50:])):
            break
        time.sleep(0.2)
    timed_out = time.monotonic() >= deadline
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(10)
    text = "".join(lines)
    found = VLLM_LINE.findall(text)
    if not found:
        ended = "timed out" if timed_out else f"exit {proc.returncode}"
        return {"error": f"no 'Model loading took' line ({ended})", "tail": text[-3000:]}
    gib, seconds = found[-1]
    return {"seconds": float(seconds), "gib": float(gib)}


# --- 4. two loads at once ------------------------------------------------------------------------


def pair_of_loads(path: Path, device: torch.device, shm: Path, repeats: int) -> dict[str, Any]:
    """Two loads of the checkpoint one after the other, and two at once (two threads, as the
    daemon runs two loads), ``repeats`` times each, alternating which goes first; medians."""

    def sequential() -> float:
        start = time.perf_counter()
        release(daemon_load(path, device, shm, "seq-a"))
        release(daemon_load(path, device, shm, "seq-b"))
        return time.perf_counter() - start

    def together() -> float:
        held: list[list[ResidentRank]] = []
        errors: list[BaseException] = []

        def run(model_id: str) -> None:
            try:
                held.append(daemon_load(path, device, shm, model_id))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(f"par-{i}",)) for i in range(2)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        for ranks in held:
            release(ranks)
        if errors:
            raise errors[0]
        return seconds

    seq: list[float] = []
    par: list[float] = []
    for i in range(repeats):
        order = [(seq, sequential), (par, together)]
        for times, fn in order if i % 2 == 0 else order[::-1]:
            times.append(fn())
    return {
        "sequential_s": statistics.median(seq),
        "together_s": statistics.median(par),
        "sequential_all_s": seq,
        "together_all_s": par,
    }


# --- the run -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--scheme", default="fp8", choices=["fp8", "fp8-pc-pt"])
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
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))

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
