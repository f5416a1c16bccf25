"""Render a kustomization as ``kubectl apply -k`` does, for the part of kustomize the manifests
under ``deploy/kubernetes`` use: ``resources`` (files, and directories holding a kustomization),
``components`` (directories holding a Component: its resources added, then its patches applied
to everything accumulated so far, as kustomize does before the parent's own patches) and
``patches`` given inline as JSON 6902 operations on a target. kustomize itself is a Go program
that PyPI does not ship, so the checks render here; the operations are applied by ``jsonpatch``
(RFC 6902, as kustomize applies them), and any other kustomization field is refused rather than
rendered differently from kustomize.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

KUSTOMIZATION = "kustomization.yaml"
FIELDS = {"apiVersion", "kind", "resources", "components", "patches"}
KINDS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}
PATCH_FIELDS = {"target", "patch"}
TARGET_FIELDS = {"group", "version", "kind", "name", "namespace"}

Resource = dict[str, Any]


class KustomizationError(ValueError):
    """A kustomization these checks cannot render as kustomize would."""


def load_kustomization(directory: Path, kind: str = "Kustomization") -> dict[str, Any]:
    data = yaml.safe_load((directory / KUSTOMIZATION).read_text())
    if (
        not isinstance(data, dict)
        or data.get("kind") != kind
        or data.get("apiVersion") != KINDS[kind]
    ):
        raise KustomizationError(f"{directory / KUSTOMIZATION} is not a {kind} ({KINDS[kind]})")
    if kind == "Component" and "components" in data:
        raise KustomizationError(f"{directory / KUSTOMIZATION}: nested components")
    unknown = set(data) - FIELDS
    if unknown:
        raise KustomizationError(
            f"{directory / KUSTOMIZATION}: {sorted(unknown)} are not rendered by these checks "
            f"(only {sorted(FIELDS)})"
        )
    return data


def resource_id(resource: Resource) -> tuple[str, str, str, str]:
    meta = resource.get("metadata", {})
    return (resource["apiVersion"], resource["kind"], meta.get("namespace", ""), meta["name"])


def _targets(resource: Resource, target: dict[str, str]) -> bool:
    group, _, version = resource["apiVersion"].rpartition("/")
    meta = resource.get("metadata", {})
    actual = {
        "group": group,
        "version": version,
        "kind": resource["kind"],
        "name": meta.get("name"),
        "namespace": meta.get("namespace", ""),
    }
    return all(actual[key] == value for key, value in target.items())


def _apply_patch(resources: list[Resource], entry: dict[str, Any], where: Path) -> None:
    if set(entry) != PATCH_FIELDS or set(entry["target"]) - TARGET_FIELDS:
        raise KustomizationError(f"{where}: a patch is an inline 'patch' with a 'target' here")
    operations = yaml.safe_load(entry["patch"])
    matched = [i for i, r in enumerate(resources) if _targets(r, entry["target"])]
    if not matched:
        raise KustomizationError(f"{where}: no resource matches the patch target {entry['target']}")
    for i in matched:
        try:
            resources[i] = jsonpatch.apply_patch(resources[i], operations)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise KustomizationError(
                f"{where}: patch of {resource_id(resources[i])}: {exc}"
            ) from exc


def _load_resources(directory: Path, data: dict[str, Any]) -> list[Resource]:
    resources: list[Resource] = []
    for entry in data.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources += render(path)
        else:
            resources += [copy.deepcopy(d) for d in yaml.safe_load_all(path.read_text()) if d]
    return resources


def render(directory: Path) -> list[Resource]:
    """Every resource the kustomization in ``directory`` builds, in order, patched."""
    data = load_kustomization(directory)
    resources = _load_resources(directory, data)
    for entry in data.get("components", []):
        component = directory / entry
        loaded = load_kustomization(component, "Component")
        resources += _load_resources(component, loaded)
        for patch in loaded.get("patches", []):
            _apply_patch(resources, patch, component / KUSTOMIZATION)
    for entry in data.get("patches", []):
        _apply_patch(resources, entry, directory / KUSTOMIZATION)
    ids = [resource_id(r) for r in resources]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise KustomizationError(f"{directory}: resources defined twice: {duplicates}")
    return resources
