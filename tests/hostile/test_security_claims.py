"""The security section's claims about bounds are the code's, and each is tried here: every
number it gives is written from the default of the flag, or the value of the constant, it
names beside it; every flag and constant it names exists; and each claim names the hostile test
(in this folder) that tries it, which must exist."""

from __future__ import annotations

import ast
import re
import socket
from pathlib import Path

import pytest

from modelopt_fp8.checkpoint import checkpoint, opened, safetensors_files
from protocol.setting import setting_of
from service.api.front import framing, limits
from service.registry import handle_server, header_budget
from service.settings import DaemonSettings

ROOT = Path(__file__).resolve().parents[2]
# The section's heading, at whatever level the page that keeps it gives it.
HEADING = re.compile(r"^#{2,3} Security and local trust$", re.MULTILINE)
MODULES = (limits, framing, checkpoint, opened, safetensors_files, header_budget, handle_server)


def section() -> str:
    """The section, wherever the documentation keeps it, with its lines joined."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        text = doc.read_text() if doc.is_file() else ""
        if found := HEADING.search(text):
            body = text[found.end() :].split("\n#", 1)[0]
            return " ".join(body.split())
    raise AssertionError(f"no {HEADING.pattern!r} in the documentation")


D = DaemonSettings.model_fields


def default(name: str) -> int:
    value = D[name].default
    assert isinstance(value, int | float)
    return int(value)


S = DaemonSettings()
# (what the section says, written from the code) -> the test that tries it
CLAIMS: dict[str, str] = {
    f"Connections: {default('max_connections')} (`--max-connections`)": (
        "test_http.py::test_connections_beyond_the_cap_make_the_idle_ones_way"
    ),
    f"{limits.PROBE_ROOM} more connections (`PROBE_ROOM`, `front/limits.py`)": (
        "test_fair_connections.py::test_connections_all_busy_leave_room_for_probes_alone"
    ),
    f"close after {limits.KEEP_ALIVE_S} s (`KEEP_ALIVE_S`": (
        "test_http.py::test_a_client_between_requests_is_the_last_to_make_way"
    ),
    f"as one caller): {S.requests_per_caller}, a quarter of the connections "
    "(`--max-requests-per-caller`)": (
        "test_fair_connections.py::test_unfinished_requests_of_one_caller_stop_at_its_share"
    ),
    "`/health` and `/ready` never count and are never refused": (
        "test_fair_connections.py::"
        "test_a_thousand_connections_of_one_allowed_user_leave_probes_room"
    ),
    f"{default('max_header_bytes') // 1024} KiB for a request's line, headers, chunk headers "
    "and trailers together (`--max-header-bytes`, 431)": (
        "test_front_bounds.py::test_chunked_trailers_count_against_the_header_limit"
    ),
    f"at most {framing.MAX_HEADER_LINES} header and trailer lines (`MAX_HEADER_LINES`": (
        "test_front_cpu.py::test_too_many_header_lines_are_refused"
    ),
    f"past its first {framing.FREE_CHUNKS} chunks a chunked body must carry "
    f"{framing.MIN_CHUNK_BYTES} bytes per chunk on average (`FREE_CHUNKS`, `MIN_CHUNK_BYTES`": (
        "test_front_cpu.py::test_a_body_of_one_byte_chunks_is_refused_after_a_few"
    ),
    f"given {limits.PARSE_PIECE // 1024} KiB at a time (`PARSE_PIECE`": (
        "test_front_cpu.py::test_16_connections_of_a_refused_user_leave_health_answering"
    ),
    f"Bodies: {default('max_body_bytes') // 1024} KiB (`--max-body-size`, 413)": (
        "test_front_cpu.py::test_nothing_is_parsed_after_a_413"
    ),
    f"for at most {limits.LINGER_S:g} s and {limits.LINGER_BYTES // 1024} KiB "
    "(`LINGER_S`, `LINGER_BYTES`": "test_front_cpu.py::test_nothing_is_parsed_after_a_403",
    f"{default('request_timeout_s')} s to send a whole request (`--request-timeout`, 408)": (
        "test_http.py::test_slow_body_times_out"
    ),
    f"At most {limits.MAX_PIPELINED} requests pipelined ahead of their answers "
    "(`MAX_PIPELINED`": "test_front_bounds.py::test_pipelining_without_reading_is_cut_off",
    f"{default('max_concurrent_loads')} at once (`--max-concurrent-loads`) and "
    f"{default('max_models')} models in all (`--max-models`": (
        "test_load_limits.py::test_a_load_flood_is_bounded"
    ),
    f"at most {opened.MAX_WEIGHT_FILES:,} safetensors files (`MAX_WEIGHT_FILES`, "
    "`modelopt_fp8/checkpoint/opened.py`) and headers of "
    f"{safetensors_files.MAX_HEADER_BYTES >> 20} MiB and {safetensors_files.MAX_TENSORS:,} "
    "tensors in all (`MAX_HEADER_BYTES`, `MAX_TENSORS`": (
        "test_checkpoint_bombs.py::"
        "test_a_checkpoint_of_too_many_files_is_refused_before_one_is_opened"
    ),
    f"Headers of more than {checkpoint.PARSED_AS_THEY_ARE // 1024} KiB (`PARSED_AS_THEY_ARE`": (
        "test_checkpoint_bombs.py::test_every_layer_needs_its_weights"
    ),
    "must have room for the linear weights of every layer the config promises "
    "(`check_header_room`)": (
        "test_checkpoint_bombs.py::test_layers_of_one_empty_tensor_each_are_refused_before_any_plan"
    ),
    f"at most {header_budget.LOADING_HEADER_BYTES >> 20} MiB of headers together "
    "(`LOADING_HEADER_BYTES`": "test_load_limits.py::test_loads_at_once_share_a_budget_of_headers",
    "none of its load's frames": (
        "test_checkpoint_bombs.py::test_a_storm_of_such_loads_gives_its_memory_back"
    ),
    f"within {handle_server.REQUEST_S:g} s of its connection (`REQUEST_S`)": (
        "test_handle_socket_bounds.py::test_a_trickled_request_is_cut_off_at_its_deadline"
    ),
    f"one user may hold {handle_server.PER_PEER} of its {handle_server.MAX_CONNECTIONS} "
    "connections (`PER_PEER`, `MAX_CONNECTIONS`": (
        "test_handle_socket_bounds.py::test_one_user_holds_at_most_its_share_of_connections"
    ),
    "a group member trickling bytes cannot keep a lease holder out": (
        "test_handle_socket_bounds.py::test_the_holder_is_answered_while_a_group_member_trickles"
    ),
    "must belong to its user or root": (
        "test_permissions.py::test_a_token_file_another_user_owns_is_refused"
    ),
    f"Caps: {default('max_leases')} leases in all, {default('max_leases_per_uid')} per user": (
        "test_lease_holders.py::test_a_neighbour_cannot_exhaust_the_table"
    ),
}


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_the_claim_is_the_codes_and_is_tried(claim: str) -> None:
    assert claim in section(), claim
    file, name = CLAIMS[claim].split("::")
    tree = ast.parse((Path(__file__).parent / file).read_text())
    tests = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert name in tests, CLAIMS[claim]


def test_every_flag_and_constant_named_exists() -> None:
    text = section()
    flags = {flag for field in D.values() for flag in setting_of(field).flags}
    for flag in re.findall(r"`(--[a-z-]+)", text):
        assert flag in flags, flag
    for constant in set(re.findall(r"`([A-Z][A-Z_]{2,})`", text)):
        if constant.startswith("WEIGHT_CACHE_") or hasattr(socket, constant):
            continue  # a variable, or the kernel's name (SO_PEERCRED)
        assert any(hasattr(module, constant) for module in MODULES), constant
