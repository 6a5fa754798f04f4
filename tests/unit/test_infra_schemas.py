"""The deployment files under infra/ checked offline against their schemas.

- Kubernetes manifests: the Kubernetes JSON schemas bundled in ``kubernetes-validate``, in
  strict mode (unknown fields refused), for the oldest and newest Kubernetes version we claim.
- The KubeRay ``RayCluster``: no registry package ships its CRD schema, so a narrower
  hand-written check of the fields KubeRay's ``ray.io/v1`` types define (required fields,
  types, replica bounds, ``rayStartParams`` as strings), with its pod templates validated as
  Kubernetes ``PodTemplate``s in strict mode.
- The compose file: the Compose Specification's JSON schema as vendored by
  ``check-jsonschema`` (``builtin_schemas/vendor/compose-spec.json``).

Plus what schemas cannot see: the search attributes registered by compose equal
``rollsafe.temporal.search_attributes``; the worker and Ray pods share one configuration,
one image and one snapshot path; drain and grace periods agree; the Dockerfile copies every
package ``pip install .`` needs and pins the Makefile's torch. Each check has a negative case.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
import shlex
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from rollsafe.temporal.search_attributes import ALL

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
COMPOSE = REPO / "infra" / "compose"
# The Kubernetes versions the manifests must be valid for: the oldest we claim, the newest
# kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")
RAY_API = "ray.io/v1"
KUSTOMIZE_API = "kustomize.config.k8s.io/v1beta1"

Doc = dict[str, Any]


# ---- loading ---------------------------------------------------------------------------------


def k8s_documents() -> list[tuple[str, Doc]]:
    """(file name, document) for every YAML document under infra/k8s."""
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def by_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in k8s_documents() if doc.get("kind") == kind]


def one(kind: str) -> Doc:
    [doc] = by_kind(kind)
    return doc


def compose() -> Doc:
    loaded: Doc = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    return loaded


@cache
def compose_schema() -> Doc:
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: Doc = json.loads(vendored.joinpath("compose-spec.json").read_text())
    return schema


# ---- validators ------------------------------------------------------------------------------


def kubernetes_errors(doc: Doc, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path)) or '<root>'}: {exc.message}"]
    return []


# Fields of KubeRay's ray.io/v1 types (ray-operator/apis/ray/v1/raycluster_types.go, KubeRay
# 1.1 to 1.4); a field of a newer KubeRay that the manifest starts to use goes here.
RAYCLUSTER_SPEC = {
    "headGroupSpec",
    "workerGroupSpecs",
    "rayVersion",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headServiceAnnotations",
    "suspend",
    "managedBy",
    "gcsFaultToleranceOptions",
}
HEAD_GROUP = {"template", "headService", "enableIngress", "rayStartParams", "serviceType"}
WORKER_GROUP = {
    "suspend",
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "idleTimeoutSeconds",
    "rayStartParams",
    "template",
    "scaleStrategy",
    "numOfHosts",
}
SERVICE_TYPES = {"ClusterIP", "NodePort", "LoadBalancer"}


def _unknown(where: str, got: Doc, known: set[str]) -> list[str]:
    return [f"{where}.{key}: unknown field" for key in sorted(set(got) - known)]


def _string_map(where: str, value: Any) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: must be a map of strings"]
    return [
        f"{where}.{key}: {item!r} must be a string (quote it)"
        for key, item in value.items()
        if not isinstance(item, str)
    ]


def _int32(where: str, value: Any, *, minimum: int = 0) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**31:
        return [f"{where}: {value!r} must be an integer >= {minimum}"]
    return []


def _template(where: str, template: Any, version: str) -> list[str]:
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
    return [
        f"{where}: {error.removeprefix('template.')}"
        for error in kubernetes_errors({**wrapped, "template": template}, version)
    ]


def _ray_resources(where: str, params: Any) -> list[str]:
    """KubeRay pastes ``resources`` into a shell ``ray start --resources=...`` line, so it must
    be one shell word: a double-quoted JSON object with escaped quotes (KubeRay's examples)."""
    value = params.get("resources") if isinstance(params, dict) else None
    if value is None:
        return []
    wrong = f'{where}.resources: must be \'"{{\\"name\\": 1}}"\' (a quoted JSON object)'
    if not (isinstance(value, str) and len(value) > 1 and value[0] == value[-1] == '"'):
        return [wrong]
    try:
        parsed = json.loads(value[1:-1].replace('\\"', '"'))
    except ValueError:
        return [wrong]
    if not isinstance(parsed, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in parsed.values()
    ):
        return [wrong]
    return []


def raycluster_errors(doc: Doc, version: str) -> list[str]:  # noqa: C901, PLR0912 (one check per schema rule)
    """The structural check of a RayCluster (no CRD schema available offline)."""
    errors: list[str] = []
    if doc.get("apiVersion") != RAY_API or doc.get("kind") != "RayCluster":
        return [f"not a {RAY_API} RayCluster: {doc.get('apiVersion')} {doc.get('kind')}"]
    errors += _unknown("<root>", doc, {"apiVersion", "kind", "metadata", "spec"})
    if not isinstance(doc.get("metadata", {}).get("name"), str):
        errors.append("metadata.name: required string")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return [*errors, "spec: required object"]
    errors += _unknown("spec", spec, RAYCLUSTER_SPEC)
    if "rayVersion" in spec and not isinstance(spec["rayVersion"], str):
        errors.append("spec.rayVersion: must be a string (quote it)")
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        return [*errors, "spec.headGroupSpec: required object"]
    errors += _unknown("spec.headGroupSpec", head, HEAD_GROUP)
    if head.get("serviceType", "ClusterIP") not in SERVICE_TYPES:
        errors.append(f"spec.headGroupSpec.serviceType: one of {sorted(SERVICE_TYPES)}")
    errors += _string_map("spec.headGroupSpec.rayStartParams", head.get("rayStartParams"))
    errors += _template("spec.headGroupSpec.template", head.get("template"), version)
    groups = spec.get("workerGroupSpecs", [])
    if not isinstance(groups, list):
        return [*errors, "spec.workerGroupSpecs: must be a list"]
    names = [group.get("groupName") for group in groups if isinstance(group, dict)]
    if len(set(names)) != len(names):
        errors.append(f"spec.workerGroupSpecs: group names repeat: {names}")
    for n, group in enumerate(groups):
        where = f"spec.workerGroupSpecs.{n}"
        if not isinstance(group, dict):
            errors.append(f"{where}: must be an object")
            continue
        errors += _unknown(where, group, WORKER_GROUP)
        if not isinstance(group.get("groupName"), str) or not group.get("groupName"):
            errors.append(f"{where}.groupName: required string")
        for field in ("minReplicas", "maxReplicas"):
            errors += _int32(f"{where}.{field}", group.get(field))
        if "replicas" in group:
            errors += _int32(f"{where}.replicas", group["replicas"])
        bounds = [group.get(f) for f in ("minReplicas", "replicas", "maxReplicas")]
        numbers = [b for b in bounds if isinstance(b, int) and not isinstance(b, bool)]
        if numbers != sorted(numbers):
            errors.append(f"{where}: needs minReplicas <= replicas <= maxReplicas, got {bounds}")
        errors += _string_map(f"{where}.rayStartParams", group.get("rayStartParams"))
        errors += _ray_resources(f"{where}.rayStartParams", group.get("rayStartParams"))
        errors += _template(f"{where}.template", group.get("template"), version)
    return errors


def kustomization_errors(doc: Doc) -> list[str]:
    listed = doc.get("resources", [])
    errors = [f"resources: {name} does not exist" for name in listed if not (K8S / name).is_file()]
    # Every manifest is applied, except the examples (secrets the operator creates).
    applied = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    missing = {name for name in applied if not name.endswith(".example.yaml")} - set(listed)
    errors += [f"resources: {name} is not listed" for name in sorted(missing)]
    errors += [
        f"resources: {name} is an example, not to be applied"
        for name in listed
        if name.endswith(".example.yaml")
    ]
    return errors


def manifest_errors(doc: Doc, version: str) -> list[str]:
    api = doc.get("apiVersion")
    if api == RAY_API:
        return raycluster_errors(doc, version)
    if api == KUSTOMIZE_API:
        return kustomization_errors(doc)
    return kubernetes_errors(doc, version)


def compose_errors(doc: Doc) -> list[str]:
    validator = jsonschema.Draft202012Validator(compose_schema())
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in validator.iter_errors(doc)
    ]


# ---- the schemas -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("name", "doc"), k8s_documents(), ids=[f"{n}:{d['kind']}" for n, d in k8s_documents()]
)
def test_every_kubernetes_manifest_validates(name: str, doc: Doc, version: str) -> None:
    assert manifest_errors(doc, version) == [], name


def test_the_kubernetes_manifests_are_the_expected_set() -> None:
    kinds = sorted(doc["kind"] for _, doc in k8s_documents())
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "Kustomization",
            "Namespace",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "RayCluster",
            "Secret",
            "Secret",
        ]
    )


def test_compose_file_validates_against_the_compose_spec() -> None:
    assert compose_errors(compose()) == []


# A broken manifest is refused: (what is broken, how, the error's start).
BROKEN_DEPLOYMENTS = [
    ("replicas as a string", lambda d: d["spec"].update(replicas="two"), "spec.replicas"),
    (
        "misspelled probe",
        lambda d: container(d).update(livenessProbes=container(d).pop("livenessProbe")),
        "spec.template.spec.containers.0",
    ),
    (
        "unknown pod field",
        lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriod=60),
        "spec.template.spec",
    ),
    (
        "port as a string",
        lambda d: container(d)["ports"][0].update(containerPort="8080"),
        "spec.template.spec.containers.0.ports.0.containerPort",
    ),
    ("no selector", lambda d: d["spec"].pop("selector"), "spec"),
]


def container(deployment: Doc) -> Doc:
    first: Doc = deployment["spec"]["template"]["spec"]["containers"][0]
    return first


def errors_once_broken(kind: str, breaks: Callable[[Doc], object]) -> list[str]:
    """What the checks say of a copy of the manifest of ``kind`` after ``breaks`` edits it."""
    broken = copy.deepcopy(one(kind))
    breaks(broken)
    return manifest_errors(broken, K8S_VERSIONS[0])


@pytest.mark.parametrize(
    ("case", "breaks", "at"), BROKEN_DEPLOYMENTS, ids=[c[0] for c in BROKEN_DEPLOYMENTS]
)
def test_a_broken_deployment_is_refused(case: str, breaks: Any, at: str) -> None:
    errors = errors_once_broken("Deployment", breaks)
    assert len(errors) == 1 and errors[0].startswith(f"{at}:"), (case, errors)


BROKEN_RAYCLUSTERS = [
    (
        "rayStartParams value not a string",
        lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
        "spec.headGroupSpec.rayStartParams.num-cpus: 0 must be a string",
    ),
    (
        "misspelled worker groups",
        lambda d: d["spec"].update(workerGroupSpec=d["spec"].pop("workerGroupSpecs")),
        "spec.workerGroupSpec: unknown field",
    ),
    (
        "replicas above maxReplicas",
        lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas=99),
        "spec.workerGroupSpecs.0: needs minReplicas <= replicas <= maxReplicas",
    ),
    (
        "no groupName",
        lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"),
        "spec.workerGroupSpecs.0.groupName: required string",
    ),
    (
        "unknown field in the head pod",
        lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
            volumeMount=[]
        ),
        "spec.headGroupSpec.template: spec.containers.0: Additional properties",
    ),
    (
        "custom resources not quoted for the shell",
        lambda d: d["spec"]["workerGroupSpecs"][1]["rayStartParams"].update(
            resources='{"data_node": 1}'
        ),
        "spec.workerGroupSpecs.1.rayStartParams.resources: must be",
    ),
    (
        "memory as a list in a worker pod",
        lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
            "resources"
        ]["limits"].update(memory=[16]),
        "spec.workerGroupSpecs.0.template: spec.containers.0.resources.limits.memory",
    ),
]


@pytest.mark.parametrize(
    ("case", "breaks", "error"), BROKEN_RAYCLUSTERS, ids=[c[0] for c in BROKEN_RAYCLUSTERS]
)
def test_a_broken_raycluster_is_refused(case: str, breaks: Any, error: str) -> None:
    errors = errors_once_broken("RayCluster", breaks)
    assert len(errors) == 1 and errors[0].startswith(error), (case, errors)


def test_a_broken_compose_file_is_refused() -> None:
    unknown = compose()
    unknown["services"]["checkpoint-worker"]["stop_grace"] = "45s"
    assert any("'stop_grace' was unexpected" in e for e in compose_errors(unknown))
    bad_ports = compose()
    bad_ports["services"]["temporal"]["ports"] = {"7233": 7233}
    assert any(e.startswith("services.temporal.ports:") for e in compose_errors(bad_ports))
    bad_depends = compose()
    bad_depends["services"]["temporal"]["depends_on"]["temporal-schema"]["condition"] = "done"
    assert compose_errors(bad_depends) != []


def test_a_kustomization_naming_a_missing_or_example_file_is_refused() -> None:
    doc = copy.deepcopy(one("Kustomization"))
    doc["resources"] = [*doc["resources"][1:], "nope.yaml", "secret-tls.example.yaml"]
    assert kustomization_errors(doc) == [
        "resources: nope.yaml does not exist",
        "resources: namespace.yaml is not listed",
        "resources: secret-tls.example.yaml is an example, not to be applied",
    ]


# ---- what the schemas cannot see -------------------------------------------------------------

REGISTER = re.compile(r"^\s*register (\S+) (\S+)\s*$", re.MULTILINE)


def cli_type(key: Any) -> str:
    """The ``temporal`` CLI's spelling of a search attribute type (KEYWORD -> Keyword)."""
    return str(key.indexed_value_type.name).title().replace("_", "")


def registered_by_compose(doc: Doc) -> list[tuple[str, str]]:
    command = doc["services"]["temporal-setup"]["command"]
    return REGISTER.findall(command if isinstance(command, str) else "\n".join(command))


def test_compose_registers_exactly_rollsafes_search_attributes() -> None:
    assert registered_by_compose(compose()) == [(key.name, cli_type(key)) for key in ALL]
    # And the check would notice a drift.
    drifted = compose()
    drifted["services"]["temporal-setup"]["command"][0] = drifted["services"]["temporal-setup"][
        "command"
    ][0].replace("register RollsafeKind Keyword", "register RollsafeKind Text")
    assert registered_by_compose(drifted) != [(key.name, cli_type(key)) for key in ALL]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_worker_deployment_is_redundant_probed_and_drains_within_its_grace() -> None:
    deployment = one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    worker = container(deployment)
    args = worker["args"]
    assert args[0] == "worker"
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pod["terminationGracePeriodSeconds"] > float(option(args, "--drain-timeout")) + 5
    [port] = [p for p in worker["ports"] if p["name"] == "health"]
    assert port["containerPort"] == int(option(args, "--health-port"))
    probes = {kind: worker[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe")}
    probes["livenessProbe"] = worker["livenessProbe"]["httpGet"]
    assert {kind: (g["path"], g["port"]) for kind, g in probes.items()} == {
        "startupProbe": ("/healthz", "health"),
        "readinessProbe": ("/healthz", "health"),
        "livenessProbe": ("/livez", "health"),
    }
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def pods() -> dict[str, Doc]:
    """Every pod spec of the run: the worker's, the Ray head's, each Ray worker group's."""
    ray = one("RayCluster")["spec"]
    found = {"worker": one("Deployment")["spec"]["template"]["spec"]}
    found["ray-head"] = ray["headGroupSpec"]["template"]["spec"]
    for group in ray["workerGroupSpecs"]:
        found[f"ray-{group['groupName']}"] = group["template"]["spec"]
    return found


def mounts(pod: Doc) -> dict[str, tuple[str, Doc]]:
    """Mount path -> (volume name, volume source) of the pod's first container."""
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    return {
        mount["mountPath"]: (mount["name"], volumes[mount["name"]])
        for mount in pod["containers"][0].get("volumeMounts", [])
    }


def test_workers_and_ray_pods_share_config_image_secrets_and_the_snapshot_volume() -> None:
    config = one("ConfigMap")
    root = config["data"]["ROLLSAFE_SNAPSHOT_ROOT"]
    [claim] = by_kind("PersistentVolumeClaim")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    images = set()
    for name, pod in pods().items():
        first = pod["containers"][0]
        images.add(first["image"])
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in first["envFrom"], name
        assert pod["securityContext"]["fsGroup"] == 1000, name  # the image's user
        mounted = mounts(pod)
        assert mounted[root][1]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        tls_dir = str(Path(config["data"]["TEMPORAL_TLS_CLIENT_CERT_PATH"]).parent)
        assert mounted[tls_dir][1]["secret"]["secretName"] == "temporal-tls", name
    assert len(images) == 1, images  # one image: Ray Client needs the same Python and Ray
    secret_names = {doc["metadata"]["name"] for doc in by_kind("Secret")}
    assert secret_names == {"temporal-tls", "temporal-api-key"}


def test_the_workers_ray_client_address_names_the_rayclusters_head_service() -> None:
    config = one("ConfigMap")["data"]
    ray = one("RayCluster")
    match = re.fullmatch(
        r"ray://([^.:]+)\.([^.:]+)\.svc\.cluster\.local:(\d+)", config["RAY_CLIENT_ADDRESS"]
    )
    assert match is not None, config["RAY_CLIENT_ADDRESS"]
    service, namespace, port = match.groups()
    assert service == f"{ray['metadata']['name']}-head-svc"  # KubeRay's head service name
    assert namespace == ray["metadata"]["namespace"]
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "client", "containerPort": int(port)} in head["ports"]
    env = {item["name"]: item for item in container(one("Deployment"))["env"]}
    assert env["RAY_ADDRESS"]["valueFrom"]["configMapKeyRef"]["key"] == "RAY_CLIENT_ADDRESS"


def test_compose_wires_workers_telemetry_and_the_shared_configuration_like_k8s() -> None:
    services = compose()["services"]
    worker = services["checkpoint-worker"]
    command = worker["command"]
    assert worker["deploy"]["replicas"] >= 2
    grace = int(worker["stop_grace_period"].removesuffix("s"))
    assert grace > float(option(command, "--drain-timeout")) + 5
    assert worker["healthcheck"]["test"][-1].endswith(
        f":{option(command, '--health-port')}/healthz"
    )
    env = worker["environment"]
    # The same variables as the Kubernetes ConfigMap, for the parts both deployments share.
    shared = {"ROLLSAFE_RUN_ID", "ROLLSAFE_SNAPSHOT_ROOT", "TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE"}
    assert shared <= set(env) and shared <= set(one("ConfigMap")["data"])
    assert env["RAY_ADDRESS"].startswith("ray://ray-head:")
    assert (
        f"--ray-client-server-port={env['RAY_ADDRESS'].rsplit(':', 1)[1]}"
        in services["ray-head"]["command"]
    )
    for name in ("checkpoint-worker", "ray-head"):  # metrics come from the controller actor
        service_env = services[name]["environment"]
        assert service_env["OTEL_METRICS_EXPORTER"] == "otlp", name
        assert service_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318", name
        assert f"snapshots:{env['ROLLSAFE_SNAPSHOT_ROOT']}" in services[name]["volumes"], name
    collector = yaml.safe_load((COMPOSE / "otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    metrics = collector["service"]["pipelines"]["metrics"]
    assert metrics["receivers"] == ["otlp"] and "prometheus" in metrics["exporters"]
    exposed = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    prometheus = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = [
        t
        for job in prometheus["scrape_configs"]
        for s in job["static_configs"]
        for t in s["targets"]
    ]
    assert f"otel-collector:{exposed}" in targets
    temporal_metrics = services["temporal"]["environment"]["PROMETHEUS_ENDPOINT"].rsplit(":", 1)[1]
    assert f"temporal:{temporal_metrics}" in targets
    # Mounted files exist (relative to the compose file).
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (COMPOSE / source).exists(), source


# ---- the Dockerfile --------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of each line of the Dockerfile, continuations joined."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def test_the_dockerfile_installs_what_pip_install_needs_and_pins_the_makefiles_torch() -> None:
    steps = dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    copied = {
        source
        for kind, args in steps
        if kind == "COPY" and "--from" not in args
        for source in shlex.split(args)[:-1]
    }
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", project["project"]["readme"]} <= copied
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    makefile = (REPO / "Makefile").read_text()
    assert f"torch=={args['TORCH_VERSION']}" in makefile
    assert ("USER", "rollsafe") in steps
    assert json.loads(dict(steps)["ENTRYPOINT"])[-1] == "rollsafe"
    cmd = json.loads(dict(steps)["CMD"])
    assert cmd[0] == "worker" and ("EXPOSE", option(cmd, "--health-port")) in steps
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", "demo-out", ".git", "**/__pycache__"} <= set(ignored)
