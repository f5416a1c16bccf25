"""What the restart proof's ``summary.json`` shows, judged and written as markdown tables: the
goals (checks computed from the figures, so a summary merged from two device calls is judged the
same way), and the tables the README quotes.

usage: python -m tests.gpu.serve_report SUMMARY [SUMMARY ...] --out DIR
       (merges the summaries of separate calls, judges them, writes summary.json and table.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

GIB = 1 << 30
PARKED_GOAL = 0.25  # parked restart at most this fraction of the default loader's restart
ADOPT_GOAL_S = 1.0  # a new daemon finds its models ready within this, counted from /health
DAEMON_OVERHEAD = GIB  # the daemon's GPU memory beyond its resident weights, at most
WARM_GOAL_S = 1.5  # kill -9 of the serving engine -> first token from the warm standby, median
ASLEEP_GOAL = 2 * GIB  # a sleeping standby's GPU memory, at most
FILL_GOAL = 0.9  # engines sized by the shared rule: KV caches and the weights, of the GPU
KV_SLACK_GIB = 0.5  # a weight_cache engine's KV cache beside the default loader's, same setting


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def donated_scheme(summary: dict[str, Any]) -> bool:
    """Whether the checkpoint's weights were donated by an engine (not processed by the
    daemon)."""
    return (summary.get("scheme") or {}).get("weights") == "donated"


def donor(run: dict[str, Any]) -> bool:
    """Whether the run is the engine that loaded a donated scheme itself and donated it."""
    return (run.get("donation") or {}).get("way") == "donated"


def restart_runs(summary: dict[str, Any], load_format: str) -> list[dict[str, Any]]:
    """The warm restart runs (A or B) that served, in order (the cold one left out, and the
    engine that donated a donated scheme: its start is vLLM's default load and the donation,
    reported on its own row)."""
    return [
        run
        for run in summary.get("runs", {}).values()
        if run.get("scenario") == "restart"
        and run.get("load_format") == load_format
        and not run.get("cold")
        and not donor(run)
        and run.get("ok")
    ]


def restart_to_first_token(summary: dict[str, Any], load_format: str) -> float | None:
    return _median(r.get("to_first_token_s") for r in restart_runs(summary, load_format))


def reference_tokens(summary: dict[str, Any]) -> list[list[int]] | None:
    """The default loader's tokens: the first A run that answered every prompt."""
    for run in summary.get("runs", {}).values():
        if run.get("load_format") == "auto" and run.get("tokens"):
            tokens: list[list[int]] = run["tokens"]
            return tokens
    return None


def _check(what: str, ok: bool, detail: object = None) -> dict[str, Any]:
    return {"check": what, "ok": bool(ok), "detail": detail}


def _token_checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    reference = reference_tokens(summary)
    checks = []
    for name, run in summary.get("runs", {}).items():
        if run.get("load_format") == "auto" or not run.get("tokens") or reference is None:
            continue
        same = run["tokens"] == reference
        detail = None if same else {"run": run["tokens"][0][:8], "A": reference[0][:8]}
        checks.append(_check(f"{name}: token ids equal the default loader's", same, detail))
    return checks


def _parked_checks(parked: dict[str, Any], a_restart: float | None) -> list[dict[str, Any]]:
    checks = [
        _check("parked: the engine parked holding no weights", parked.get("parked") is True),
        _check(
            "parked: the parked engine served after the kill",
            parked.get("kill_to_first_token_s") is not None,
            parked.get("error"),
        ),
        _check("parked: tokens equal before and after", parked.get("tokens_equal") is True),
    ]
    kill_to_token = parked.get("kill_to_first_token_s")
    if kill_to_token is not None and a_restart is not None:
        goal = a_restart * PARKED_GOAL
        checks.append(
            _check(
                f"parked: kill -9 -> first token <= 1/4 of the default loader's restart "
                f"({kill_to_token} s vs {goal:.2f} s)",
                kill_to_token <= goal,
            )
        )
    return checks


def _stream_checks(name: str, account: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not account:
        return [_check(f"{name}: requests streamed", False, "no stream")]
    return [
        _check(
            f"{name}: no request failed ({account['failed']} of {account['requests']})",
            account["failed"] == 0 and account["requests"] > 0,
            account.get("failures") or None,
        ),
        _check(f"{name}: every answer's tokens equal", account.get("wrong_tokens") == 0),
    ]


def _daemon_checks(restart: dict[str, Any]) -> list[dict[str, Any]]:
    """A donated model (``donated_model``) is adopted from the keeper as the daemon's own is;
    the check that the new daemon did not read the checkpoint is left out for it (the proof
    says so in ``skipped``): a daemon that processes no model reads none."""
    new = restart.get("new_daemon") or {}
    donated = restart.get("donated_model")
    checks = _stream_checks("daemon restart", restart.get("account"))
    checks.append(
        _check(
            "daemon restart: the engine kept answering while no daemon ran",
            restart.get("answered_without_daemon", 0) > 0,
        )
    )
    checks.append(_check("daemon restart: the new daemon is ready", new.get("ready") is True))
    adopt = restart.get("adopt_s")
    checks.append(
        _check(
            f"daemon restart: model ready within {ADOPT_GOAL_S} s of the new daemon's /health "
            f"({adopt} s)",
            adopt is not None and adopt <= ADOPT_GOAL_S,
        )
    )
    if donated is None:
        read, size = new.get("read_bytes"), restart.get("checkpoint_bytes")
        checks.append(
            _check(
                "daemon restart: the new daemon did not read the checkpoint "
                f"(read {read} bytes, checkpoint {size})",
                read is not None and size is not None and read < size // 4,
            )
        )
    else:
        held = {m.get("id"): m.get("state") for m in new.get("models") or []}
        checks.append(
            _check(
                f"daemon restart: the new daemon holds the donated model {donated} again",
                held.get(donated) == "ready",
                held,
            )
        )
    checks.append(
        _check(
            "daemon restart: the engine's lease taken over",
            restart.get("lease_taken_over") is True,
            {"before": restart.get("leases_before"), "after": restart.get("leases_after")},
        )
    )
    return checks


def _daemon_memory_checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The daemon's own GPU memory with the weights resident: the resident weights and at most
    ``DAEMON_OVERHEAD`` more (where the driver was asked). Read idle after its load, or, for a
    donated scheme, once the donation was made (the daemon starts with none)."""
    if donated_scheme(summary):
        donation = summary.get("donation") or {}
        held = (donation.get("memory") or {}).get("daemon")
        models = [donation] if donation.get("bytes_resident") is not None else []
    else:
        daemon = summary.get("daemon") or {}
        held, models = (daemon.get("memory") or {}).get("daemon"), daemon.get("models") or []
    if held is None or not models:
        return []
    resident = sum(m.get("bytes_resident") or 0 for m in models)
    return [
        _check(
            f"daemon: GPU memory at most the resident weights + 1 GiB ({_gib(held)} for "
            f"{_gib(resident)})",
            held <= resident + DAEMON_OVERHEAD,
        )
    ]


def evaluate(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The checks the figures decide: tokens against the default loader's, the daemon's memory,
    and each scenario's goals (parked restart, no failed request, daemon re-adoption)."""
    checks = _token_checks(summary) + _daemon_memory_checks(summary)
    checks += _donation_checks(summary) + _kv_cache_checks(summary)
    scenarios = summary.get("scenarios", {})
    if "parked" in scenarios:
        checks += _parked_checks(scenarios["parked"], restart_to_first_token(summary, "auto"))
    if "standby" in scenarios:
        checks += _stream_checks("hot standby", scenarios["standby"].get("account"))
    if "daemon_restart" in scenarios:
        checks += _daemon_checks(scenarios["daemon_restart"])
    for name, crowd in each_of(scenarios, "crowd", "crowd_serving"):
        checks += _crowd_checks(name, crowd)
    for name, warm in each_of(scenarios, "warm", "tight"):
        checks += _warm_checks(name, warm)
    if "container" in scenarios:
        checks += _container_checks(summary.get("runs", {}).get("K1"))
    return checks


def _donation_checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """A donated scheme whose ``weight_cache`` engines ran: the daemon held their donation (each
    engine's own check, whether it donated or attached, the proof makes as it loads)."""
    runs = summary.get("runs", {}).values()
    engines = any(run.get("load_format") == "weight_cache" for run in runs)
    engines |= bool({"warm", "tight"} & set(summary.get("scenarios", {})))
    if not donated_scheme(summary) or not engines:
        return []
    donation = summary.get("donation") or {}
    return [
        _check(
            f"donation: the daemon held the model a weight_cache engine donated "
            f"({donation.get('model', 'none')})",
            donation.get("state") == "ready",
            None if donation.get("state") == "ready" else donation or "no engine donated",
        )
    ]


# The runs whose engine started alone at the proof's --gpu-memory-utilization: the restart
# scenario's, R0 (the default loader's tokens) and the donor of a donated scheme.
ALONE_SCENARIOS = ("restart", "reference", "donation")


def _kv_cache_checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``weight_cache`` engine started alone (the donor of a donated scheme included) sized
    its KV cache as vLLM's default loader does at the same ``--gpu-memory-utilization``: the
    weights it attached to, or gave the daemon, count as its own while it sizes (a bf16 donor
    once took three times the default loader's KV cache)."""
    runs = {
        name: run
        for name, run in summary.get("runs", {}).items()
        if run.get("scenario") in ALONE_SCENARIOS and run.get("ok")
    }
    reference = _median(
        (run.get("phases") or {}).get("kv_cache_gib")
        for run in runs.values()
        if run.get("load_format") == "auto"
    )
    if reference is None:
        return []
    checks = []
    for name, run in runs.items():
        if run.get("load_format") != "weight_cache":
            continue
        kv = (run.get("phases") or {}).get("kv_cache_gib")
        checks.append(
            _check(
                f"{name}: KV cache as the default loader's at the same setting ({kv} GiB "
                f"against {reference} GiB, within {KV_SLACK_GIB} GiB)",
                kv is not None and abs(kv - reference) <= KV_SLACK_GIB,
            )
        )
    return checks


def _container_checks(fresh: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A restart on an empty filesystem found its compiled graph on the kept cache volume (it
    did not compile again)."""
    if fresh is None or not fresh.get("ok"):
        return [_check("container: the restart on an empty filesystem answered", False)]
    compiled = (fresh.get("phases") or {}).get("torch_compile_s")  # None: vLLM logged none
    return [
        _check(
            "container: the restart on an empty filesystem took its compiled graph from the "
            f"kept cache volume (torch.compile {compiled} s)",
            compiled is not None and not fresh.get("cold"),
        )
    ]


def _crowd_checks(name: str, crowd: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    runs = crowd.get("runs") or []
    if not runs:
        return [_check(f"{name}: ran", False)]
    for index, run in enumerate(runs, 1):
        what = (
            f"{name} run {index}: every engine started at once answered "
            f"({run.get('answered', 0)} of {crowd['engines']})"
        )
        checks.append(_check(what, run.get("answered") == crowd["engines"]))
        share = run.get("kv_and_weights_share")
        if crowd.get("rule") and share is not None:
            checks.append(
                _check(
                    f"{name} run {index}: KV caches and the weights once fill at least "
                    f"{FILL_GOAL:.0%} of the GPU ({share:.1%})",
                    share >= FILL_GOAL,
                )
            )
    return checks


def engine_held(takeover: dict[str, Any], engine: str, key: str) -> int:
    """GPU bytes the processes of ``engine`` held in one reading (the daemon's left out)."""
    memory = takeover.get(key) or {}
    return sum(b for name, b in memory.items() if name.startswith(f"{engine}."))


def _warm_checks(name: str, warm: dict[str, Any]) -> list[dict[str, Any]]:
    takeovers = warm.get("takeovers") or []
    times = [t.get("kill_to_first_token_s") for t in takeovers]
    checks = [
        _check(
            f"{name}: every takeover served ({sum(t is not None for t in times)} of "
            f"{len(takeovers)})",
            bool(takeovers) and all(t is not None for t in times),
        ),
        _check(
            f"{name}: tokens equal the {warm.get('reference', 'default loader')}'s after every "
            "takeover",
            bool(takeovers) and all(t.get("tokens_equal") for t in takeovers),
        ),
    ]
    checks += _stream_checks(name, warm.get("account"))
    asleep = [engine_held(t, t["woken"], "asleep_memory") for t in takeovers]
    checks.append(
        _check(
            f"{name}: a sleeping standby holds at most 2 GiB "
            f"({', '.join(_gib(b) for b in asleep)})",
            bool(asleep) and all(0 < b <= ASLEEP_GOAL for b in asleep),
        )
    )
    median = _median(times)
    if scenario_kind(name) == "warm":
        checks.append(
            _check(
                f"warm: kill -9 -> first token through the proxy <= {WARM_GOAL_S} s, median of "
                f"{len(times)} ({median} s)",
                median is not None and len(times) >= 3 and median <= WARM_GOAL_S,
            )
        )
    return checks


CALL_SUFFIX = ".call"  # a merge keeps a later call's run or scenario of a taken name as NAME.callN


def merged_name(name: str, taken: dict[str, Any], call: int) -> str:
    """The name a merge keeps call ``call``'s ``name`` under: its own unless an earlier call took
    it."""
    return f"{name}{CALL_SUFFIX}{call}" if name in taken else name


def scenario_kind(name: str) -> str:
    """The scenario a merged summary keeps under ``name`` (``crowd.call3`` is a ``crowd``)."""
    return name.partition(CALL_SUFFIX)[0]


def each_of(scenarios: dict[str, Any], *kinds: str) -> list[tuple[str, dict[str, Any]]]:
    """The scenarios of these kinds, each call's own where a merge kept several of one kind
    (``crowd``, ``crowd.call3``), in the order of ``kinds``."""
    return [
        (name, scenario)
        for kind in kinds
        for name, scenario in scenarios.items()
        if scenario_kind(name) == kind
    ]


def merge(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary from several calls' (later calls' runs and scenarios added; checks taken as
    each call made them, a later call's named after it, then judged again on the whole)."""
    merged: dict[str, Any] = {"calls": [], "runs": {}, "scenarios": {}, "checks": []}
    merged["skipped"] = []
    for index, summary in enumerate(summaries, 1):
        merged["calls"].append(summary.get("config", {}))
        for key in ("daemon", "checkpoint", "scheme", "donation"):  # the first call's
            if summary.get(key) and key not in merged:
                merged[key] = summary[key]
        merged["skipped"] += summary.get("skipped", [])
        for key in ("runs", "scenarios"):
            for name, entry in summary.get(key, {}).items():
                merged[key][merged_name(name, merged[key], index)] = entry
        merged["checks"] += [
            dict(c, check=f"call {index}: {c['check']}") if index > 1 else c
            for c in summary.get("checks", [])
            if not c.get("judged")
        ]  # a later call's checks name its runs as that call did (R0, not R0.call2)
    merged["checks"] += [dict(c, judged=True) for c in evaluate(merged)]
    return merged


WAYS = {  # how a weight_cache engine of a donated scheme loaded, as the tables say it
    "donated": "loaded and donated",
    "attached": "attached to the donation",
    "own_load": "served its own load",
    "unsaid": "no donation logged",
}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f} GiB"


def memory_cell(memory: dict[str, int] | None) -> str:
    """Processes holding GPU memory, largest first (``name 8.46 GiB``)."""
    if not memory:
        return "-"
    held = sorted(((b, n) for n, b in memory.items() if b), reverse=True)
    return ", ".join(f"{name} {_gib(b)}" for b, name in held) or "-"


def runs_table(summary: dict[str, Any]) -> list[str]:
    rows = [
        '| run | "Model loading took" | init engine (profile, KV cache, graphs; compile) | '
        "API server first line | EngineCore first line | to /health | to first token | "
        "GPU memory per process |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in summary.get("runs", {}).items():
        if run.get("scenario") not in ("restart", "container", "donation"):
            continue
        ph = run.get("phases", {})
        at = ph.get("at_s", {})
        loading = (
            f"{ph['model_loading_gib']} GiB, {ph['model_loading_s']:.2f} s"
            if "model_loading_s" in ph
            else "-"
        )
        init = (
            f"{ph['init_engine_s']:.2f} s ({ph.get('compilation_s', 0):.1f} s)"
            if "init_engine_s" in ph
            else "-"
        )
        notes = [run["load_format"]] + (["cold compile cache"] if run.get("cold") else [])
        way = (run.get("donation") or {}).get("way")
        if way is not None:
            notes.append(WAYS.get(way, way))
        if run.get("env") == "container":
            notes.append("empty filesystem, cache volume kept")
        label = f"{name} ({', '.join(notes)})"
        if not run.get("ok"):
            label += f" failed: {run.get('error', '')[:60]}"
        rows.append(
            f"| {label} | {loading} | {init} | {_s(at.get('api_server_first_line'))} | "
            f"{_s(at.get('engine_core_first_line'))} | {_s(run.get('to_health_s'))} | "
            f"{_s(run.get('to_first_token_s'))} | {memory_cell(run.get('memory'))} |"
        )
    return rows


def side_by_side(summary: dict[str, Any]) -> list[str]:
    """Restart to first token for each topology, and the GPU memory each holds."""
    scenarios = summary.get("scenarios", {})

    def memory_of(fmt: str) -> str:
        chosen = restart_runs(summary, fmt)
        return memory_cell(chosen[-1].get("memory")) if chosen else "-"

    attached = ", attached to the donation" if donated_scheme(summary) else ""
    rows = [
        "| restart | to first token | GPU memory per process |",
        "| --- | --- | --- |",
        f"| `vllm serve`, vLLM's default loader (warm, median) | "
        f"{_s(restart_to_first_token(summary, 'auto'))} | {memory_of('auto')} |",
        f"| `vllm serve --load-format weight_cache` (warm, median{attached}) | "
        f"{_s(restart_to_first_token(summary, 'weight_cache'))} | {memory_of('weight_cache')} |",
    ]
    for name, run in summary.get("runs", {}).items():
        if donor(run):
            rows.append(
                f"| `vllm serve --load-format weight_cache`, the first ({name}): vLLM's default "
                f"load, then donated | {_s(run.get('to_first_token_s'))} | "
                f"{memory_cell(run.get('memory'))} |"
            )
    parked = scenarios.get("parked")
    if parked:
        rows.append(
            f"| parked engine released (kill -9 of the serving one -> first token through the "
            f"proxy) | {_s(parked.get('kill_to_first_token_s'))} | while parked: "
            f"{memory_cell(parked.get('memory_parked'))}; serving: "
            f"{memory_cell(parked.get('memory_after'))} |"
        )
    standby = scenarios.get("standby")
    if standby:
        account = standby.get("account") or {}
        rows.append(
            f"| hot standby (kill -9 of one of two engines under a stream) | none: "
            f"{account.get('failed', '-')} of {account.get('requests', '-')} requests failed, "
            f"slowest during the kill {_s(account.get('slowest_in_window_s'))} | "
            f"{memory_cell(standby.get('memory'))}; the second engine "
            f"{_gib(standby.get('second_engine_bytes'))} |"
        )
    return rows


def daemon_table(restart: dict[str, Any]) -> list[str]:
    new = restart.get("new_daemon") or {}
    account = restart.get("account") or {}
    return [
        "| new daemon /health | model ready | ready after /health | bytes read by the new daemon "
        "| requests (failed) | answered with no daemon | tokens equal | leases taken over |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {_s(new.get('health_s'))} | {_s(new.get('ready_s'))} | "
        f"{restart.get('adopt_s', '-')} s | {new.get('read_bytes', '-')} | "
        f"{account.get('requests', '-')} ({account.get('failed', '-')}) | "
        f"{restart.get('answered_without_daemon', '-')} | "
        f"{'yes' if account.get('wrong_tokens') == 0 else 'no'} | "
        f"{'yes' if restart.get('lease_taken_over') else 'no'} |",
    ]


def crowd_table(name: str, crowd: dict[str, Any]) -> list[str]:
    beside = " while another engine serves" if crowd.get("beside") else ""
    out = [f"## {crowd['engines']} engines started at once{beside}", ""]
    out += [
        "| run | utilization each | answered | to /health | KV cache each | KV caches + "
        "weights, of the GPU | GPU memory per process |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, run in enumerate(crowd.get("runs") or [], 1):
        healths = ", ".join(_s(t) for t in run.get("to_health_s", []))
        kv = ", ".join("-" if k is None else f"{k:.2f} GiB" for k in run.get("kv_cache_gib", []))
        share = run.get("kv_and_weights_share")
        out.append(
            f"| {index} | {run.get('utilization')} | {run.get('answered', 0)} of "
            f"{crowd['engines']} | {healths} | {kv} | "
            f"{'-' if share is None else f'{share:.1%}'} | {memory_cell(run.get('memory'))} |"
        )
    return [*out, ""]


def warm_table(name: str, warm: dict[str, Any]) -> list[str]:
    title = "Warm standby" if scenario_kind(name) == "warm" else "Warm standby, memory tight"
    utilization = warm.get("utilization")
    out = [f"## {title}" + (f" (every engine at {utilization})" if utilization else ""), ""]
    out += [
        "| killed -> woken | kill -> first token | released after kill | awake after kill "
        "(memory wait, wake) | direct answer | standby asleep | KV cache (killed, woken) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in warm.get("takeovers") or []:
        kv = t.get("kv_cache_gib") or {}
        out.append(
            f"| {t['killed']} -> {t['woken']} | {_s3(t.get('kill_to_first_token_s'))} | "
            f"{_s3(t.get('released_after_kill_s'))} | {_s3(t.get('awake_after_kill_s'))} "
            f"({_s3(t.get('room_wait_s'))}, {_s3(t.get('wake_s'))}) | "
            f"{_s3(t.get('direct_answer_s'))} | "
            f"{_gib(engine_held(t, t['woken'], 'asleep_memory'))} | "
            f"{', '.join(f'{n} {v} GiB' for n, v in kv.items())} |"
        )
    account = warm.get("account") or {}
    out += [
        "",
        f"Requests through the proxy: {account.get('requests', '-')}, failed "
        f"{account.get('failed', '-')}.",
        "",
    ]
    return out


def _s3(value: float | str | None) -> str:
    return "-" if value is None else f"{float(value):.3f} s"


def scheme_lines(summary: dict[str, Any]) -> list[str]:
    """The checkpoint's shape and scheme, and who processed its weights."""
    scheme = summary.get("scheme")
    if not scheme:
        return []
    if scheme.get("weights") != "donated":
        how = "processed by the daemon before any engine started"
    else:
        donation = summary.get("donation") or {}
        made = ""
        if donation.get("engine"):
            made = f" ({donation['engine']}: {donation.get('model')}, "
            made += f"{_gib(donation.get('bytes_resident'))})"
        how = (
            "donated: the daemon processes none of this scheme; the first `weight_cache` engine "
            f"loaded it with vLLM's default loader and donated it{made}, the later ones "
            "attached to it"
        )
    return [f"Checkpoint: {scheme.get('shape')} in `{scheme.get('scheme')}`; weights {how}.", ""]


def render(summary: dict[str, Any]) -> str:
    """The markdown the proof writes beside its summary."""
    out = ["# `vllm serve` restarts with and without weight-cache", ""]
    out += scheme_lines(summary)
    daemon = summary.get("daemon") or {}
    if daemon.get("ready") and donated_scheme(summary):
        donation = summary.get("donation") or {}
        out += [
            f"The daemon: /health {_s(daemon.get('health_s'))} after its start, holding no model; "
            f"GPU memory then: {memory_cell(daemon.get('memory'))}; once the model was donated: "
            f"{memory_cell(donation.get('memory'))}.",
            "",
        ]
    elif daemon.get("ready"):
        out += [
            f"The daemon: /health {_s(daemon.get('health_s'))}, ready {_s(daemon.get('ready_s'))} "
            f"after its start; GPU memory idle after the load: "
            f"{memory_cell(daemon.get('memory'))}.",
            "",
        ]
    if summary.get("runs"):
        out += ["## Restart to first token, side by side", "", *side_by_side(summary), ""]
        out += ["## Each `vllm serve` start (seconds from the process's start)", ""]
        out += [*runs_table(summary), ""]
    if "daemon_restart" in summary.get("scenarios", {}):
        out += ["## The daemon killed and started again under a serving engine", ""]
        out += [*daemon_table(summary["scenarios"]["daemon_restart"]), ""]
    for name, crowd in each_of(summary.get("scenarios", {}), "crowd", "crowd_serving"):
        out += crowd_table(name, crowd)
    for name, warm in each_of(summary.get("scenarios", {}), "warm", "tight"):
        out += warm_table(name, warm)
    checks = summary.get("checks", [])
    failed = [c for c in checks if not c["ok"]]
    out += [f"## Checks: {len(checks) - len(failed)} passed, {len(failed)} failed", ""]
    out += [f"- {'PASS' if c['ok'] else 'FAIL'} {c['check']}" for c in checks]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("summaries", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    merged = merge([json.loads(path.read_text()) for path in args.summaries])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(merged, indent=1))
    (args.out / "table.md").write_text(render(merged))
    print(render(merged))
    return 1 if any(not c["ok"] for c in merged["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
