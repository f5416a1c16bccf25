"""The end-to-end proof on a GPU, as one re-runnable script
(``python -m tests.gpu.gpu_proof OUT [SHAPE] [fd|ipc]``).

A daemon process (uvicorn, ``--device cuda:0``, ``--cuda-handles fd`` by default) holds a demo
checkpoint of each scheme. For each, an engine process loads the model four ways: an ordinary
load from disk, a fallback load with the daemon unreachable, an attach, and a second attach
(fallback forbidden on both; descriptors, or legacy IPC handles with ``ipc``).
Every layer's ``torch._scaled_mm`` output must be bitwise equal across the four; the two attaches
must share the daemon's memory (same pointers, no copy). Results go to ``OUT/gpu_proof.json``.
On a machine without CUDA it runs the same steps on the CPU twin (shared memory, emulated GEMM).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine_client.checkpoint_read import EngineWeights, attach_or_read, read_checkpoint
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from harness.daemon_process import free_port, start_daemon
from service.demo import write_demo_checkpoint
from weight_cache_cli.attach import run_layers

SCHEMES = ("fp8", "fp8-pc-pt")


def _outputs_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def engine(url: str, model: str, checkpoint: Path) -> dict[str, Any]:
    """One engine process: the four loads and their comparisons."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    report: dict[str, Any] = {"model": model, "device": str(device)}
    start = time.perf_counter()
    if cuda:
        torch.cuda.init()
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize()
    report["context_ms"] = (time.perf_counter() - start) * 1e3
    expect = Expectations.for_checkpoint(checkpoint, device)

    start = time.perf_counter()
    disk, layers = read_checkpoint(checkpoint, device)
    if cuda:
        torch.cuda.synchronize()
    report["ordinary_load_ms"] = (time.perf_counter() - start) * 1e3
    reference = run_layers(layers, disk, device)

    unreachable = ClientConfig(url=f"http://127.0.0.1:{free_port()}", retries=0)
    fallback = attach_or_read(model, checkpoint, expect, config=unreachable, fallback=True)
    report["fallback"] = {
        "source": fallback.source,
        "reason": fallback.reason,
        "ms": fallback.seconds * 1e3,
        "bitwise_equal": _outputs_equal(
            reference, run_layers(fallback.layers, fallback.tensors, device)
        ),
    }

    allocated = torch.cuda.memory_allocated(device) if cuda else 0
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else 0
    attaches: list[EngineWeights] = []
    for label in ("attach_1", "attach_2"):
        result = attach_or_read(
            model, checkpoint, expect, config=ClientConfig(url=url), fallback=False
        )
        assert result.attachment is not None
        att = result.attachment
        attaches.append(result)
        report[label] = {
            "source": result.source,
            "lease_ms": att.timings.lease_ms,
            "verify_ms": att.timings.verify_ms,
            "open_ms": att.timings.open_ms,
            "rebuild_ms": att.timings.rebuild_ms,
            "attach_ms": att.timings.attach_ms,
            "zero_copy": att.zero_copy(),
            "via": att.arena.via,
            "bitwise_equal": _outputs_equal(reference, run_layers(att.layers, att.tensors, device)),
            "layouts_equal_ordinary_load": att.layers == layers,
        }
    first, second = (r.tensors for r in attaches)
    leased = attaches[0].attachment.nbytes if attaches[0].attachment else 0
    if cuda:
        # Mapping the daemon's memory twice takes no device memory of its own.
        drop = free_before - torch.cuda.mem_get_info(device)[0]
        report["device_memory_drop_bytes"] = drop
        report["attaches_take_no_device_memory"] = drop < max(leased, 64 << 20)
    if cuda and report["attach_1"]["via"] == "cuda_ipc":
        # torch maps one IPC allocation once per process: the same device pointers
        report["attaches_share_pointers"] = all(
            first[n].data_ptr() == second[n].data_ptr() for n in first
        )
    elif cuda:  # each attach maps the daemon's allocation from its own descriptor
        report["attaches_share_pointers"] = None
    else:  # two read-only mappings of the same shared-memory file: the same pages
        handles = [r.attachment.grant.arenas[0].handle for r in attaches if r.attachment]
        report["attaches_share_pointers"] = len({getattr(h, "path", None) for h in handles}) == 1
    report["engine_allocator_growth_bytes"] = (
        torch.cuda.memory_allocated(device) - allocated if cuda else 0
    )
    report["leased_bytes"] = attaches[0].attachment.nbytes if attaches[0].attachment else 0
    report["tensors"] = len(first)
    report["layers"] = len(layers)
    for r in attaches:
        if r.attachment is not None:
            r.attachment.close()
    return report


def main(out: Path, shape: str = "qwen2.5-0.5b", handles: str = "fd") -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    checkpoints = []
    for scheme in SCHEMES:
        path = out / "checkpoints" / f"proof-{scheme}"
        if not (path / "config.json").is_file():
            write_demo_checkpoint(path, scheme, shape)
        checkpoints.append(path)
    work = out / "daemon"
    work.mkdir(exist_ok=True)
    models = [item for p in checkpoints for item in ("--model", str(p))]
    daemon = start_daemon(
        work, [], *models, "--cuda-handles", handles, device=device, timeout_s=600
    )
    summary: dict[str, Any] = {
        "shape": shape,
        "daemon_device": device,
        "cuda_handles": handles,
        "runs": [],
    }
    try:
        inventory = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"import httpx; print(httpx.get('{daemon.url}/v1/inventory').text)",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        summary["daemon_inventory"] = inventory
        for path in checkpoints:
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tests.gpu.gpu_proof",
                    "engine",
                    daemon.url,
                    path.name,
                    str(path),
                ],
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            if result.returncode != 0:
                summary["runs"].append({"model": path.name, "error": result.stderr[-4000:]})
                continue
            summary["runs"].append(json.loads(result.stdout.strip().splitlines()[-1]))
    finally:
        daemon.stop()
        summary["daemon_log_tail"] = daemon.log.read_text()[-3000:]
    ok = len(summary["runs"]) == len(SCHEMES) and all(
        "error" not in r
        and r["fallback"]["reason"] == "daemon_unavailable"
        and r["fallback"]["bitwise_equal"]
        and r["attaches_share_pointers"] in (True, None)
        and r.get("attaches_take_no_device_memory", True)
        and r["engine_allocator_growth_bytes"] == 0
        and all(
            r[a]["bitwise_equal"]
            and r[a]["zero_copy"]
            and r[a]["layouts_equal_ordinary_load"]
            and r[a]["source"] == "daemon"
            for a in ("attach_1", "attach_2")
        )
        for r in summary["runs"]
    )
    summary["all_checks_passed"] = ok
    (out / "gpu_proof.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        print(json.dumps(engine(sys.argv[2], sys.argv[3], Path(sys.argv[4]))))
    else:
        result = main(Path(sys.argv[1]), *(sys.argv[2:4]))
        for run in result["runs"]:
            if "error" in run:
                print(run["model"], "ERROR", run["error"][-800:])
                continue
            print(
                f"{run['model']} ({result['cuda_handles']}, {run['attach_1']['via']}): "
                f"ordinary {run['ordinary_load_ms']:.1f} ms, "
                f"attach {run['attach_1']['attach_ms']:.2f} / {run['attach_2']['attach_ms']:.2f}"
                f" ms, bitwise {run['attach_1']['bitwise_equal']}, shared pointers "
                f"{run['attaches_share_pointers']}, fallback {run['fallback']['reason']}"
            )
        print("all checks passed:", result["all_checks_passed"])
        sys.exit(0 if result["all_checks_passed"] else 1)
