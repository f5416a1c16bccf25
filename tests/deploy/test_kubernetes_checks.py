"""The Kubernetes manifests as a cluster's admission and a security scanner see them: every
topology rendered, validated against the pinned Kubernetes version's schemas (and the newest the
validator knows), and scanned by checkov with every finding fixed or waived in one file."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.kubernetes_files import (
    DRA_API_VERSION,
    KUBERNETES,
    MIN_KUBERNETES,
    TOPOLOGIES,
    WAIVERS,
    all_resources,
    rendered,
    tool,
    write_rendered,
)
from tests.deploy.kustomize import KUSTOMIZATION, load_kustomization


def test_the_topologies_are_there() -> None:
    assert {"sidecar", "sidecar-legacy-ipc", "node-cache"} <= set(TOPOLOGIES)


@pytest.mark.parametrize(
    "directory",
    [p.parent for p in sorted(KUBERNETES.glob("components/*/kustomization.yaml"))],
    ids=lambda p: p.name,
)
def test_every_component_file_is_in_its_component(directory: Path) -> None:
    listed = set(load_kustomization(directory, "Component").get("resources", []))
    present = {p.name for p in directory.glob("*.yaml")} - {KUSTOMIZATION}
    assert listed == present


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_manifest_file_is_in_its_kustomization(topology: str) -> None:
    """A manifest left out of its kustomization is never applied."""
    directory = KUBERNETES / topology
    listed = {
        entry
        for entry in load_kustomization(directory).get("resources", [])
        if (directory / entry).is_file()
    }
    present = {p.name for p in directory.glob("*.yaml")} - {KUSTOMIZATION}
    assert listed == present


def test_dra_objects_use_the_api_version_the_pinned_kubernetes_serves() -> None:
    dra = [(t, r) for t, r in all_resources() if r["apiVersion"].startswith("resource.k8s.io/")]
    assert {r["kind"] for _, r in dra} == {"ResourceClaim", "ResourceClaimTemplate"}
    assert all(r["apiVersion"] == DRA_API_VERSION for _, r in dra), dra


def _newest_kubernetes(validate: Path) -> str:
    out = subprocess.run([validate, "--help"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"Defaults to (\d+\.\d+\.\d+)", " ".join(out.split()))
    assert match, out
    return match.group(1)


def test_schemas_of_the_pinned_and_the_newest_kubernetes(tmp_path: Path) -> None:
    """Strict validation (unknown fields refused) of every rendered document, against the oldest
    Kubernetes the manifests are for and the newest the validator knows; a document of a kind it
    has no schema for fails rather than passing unchecked."""
    validate = tool("kubernetes-validate")
    files = write_rendered(tmp_path)
    expected = sum(len(rendered(t)) for t in TOPOLOGIES)
    for version in sorted({MIN_KUBERNETES, _newest_kubernetes(validate)}):
        out = subprocess.run(
            [validate, "--strict", "--kubernetes-version", version, *map(str, files.values())],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = (out.stdout + out.stderr).splitlines()
        passed = [line for line in lines if line.startswith("INFO") and " passed " in line]
        problems = [line for line in lines if not line.startswith("INFO")]
        assert out.returncode == 0 and not problems, "\n".join(problems)
        assert len(passed) == expected, (version, lines)


def _waivers() -> dict[str, dict[str, Any]]:
    entries = yaml.safe_load(WAIVERS.read_text())["waivers"]
    waivers: dict[str, dict[str, Any]] = {}
    for entry in entries:
        assert entry["check"] not in waivers, f"{entry['check']} waived twice"
        assert len(entry["reason"].split()) >= 10, f"{entry['check']}: say why it is waived"
        assert entry["resources"], entry
        waivers[entry["check"]] = entry
    return waivers


def test_checkov_findings_are_fixed_or_waived(tmp_path: Path) -> None:
    """checkov's Kubernetes checks on every rendered topology: each failed check must be waived
    for that resource in checkov-waivers.yaml (with a reason), and each waiver must still be
    needed by some finding."""
    checkov = tool("checkov")
    write_rendered(tmp_path / "rendered")
    out = subprocess.run(
        [
            checkov,
            "--directory",
            str(tmp_path / "rendered"),
            "--framework",
            "kubernetes",
            "--skip-download",  # no network: checks only, no guideline links
            "--soft-fail",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": str(checkov.parent), "HOME": str(tmp_path), "LANG": "C.UTF-8"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    assert report["summary"]["parsing_errors"] == 0, report["summary"]
    results = report["results"]
    scanned = {c["resource"] for c in results["passed_checks"] + results["failed_checks"]}
    workloads = {
        f"{r['kind']}.{r['metadata']['namespace']}.{r['metadata']['name']}"
        for _, r in all_resources()
        if r["kind"] in {"Deployment", "DaemonSet"}
    }
    assert workloads <= scanned, workloads - scanned

    waivers = _waivers()
    used: set[tuple[str, str]] = set()
    unwaived = []
    for failure in results["failed_checks"]:
        check, resource = failure["check_id"], failure["resource"]
        if resource in waivers.get(check, {}).get("resources", []):
            used.add((check, resource))
        else:
            unwaived.append(f"{check} {failure['check_name']}: {resource} ({failure['file_path']})")
    assert not unwaived, "fix these, or waive them with a reason:\n" + "\n".join(unwaived)
    stale = [
        f"{check} {resource}"
        for check, entry in waivers.items()
        for resource in entry["resources"]
        if (check, resource) not in used
    ]
    assert not stale, f"waivers no finding needs any more: {stale}"
