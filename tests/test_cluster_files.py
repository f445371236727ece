"""The files in clusters/: valid for Ray's launcher and KubeRay, pinned to our Ray, closed to the internet."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import ray.autoscaler
import yaml
from ray.autoscaler.sdk import fillout_defaults

from speed.paths import repo_root

CLUSTERS = repo_root() / "clusters"
LAUNCHER_FILES = sorted(CLUSTERS.glob("*.yaml"))
KUBERAY_FILES = sorted((CLUSTERS / "kuberay").glob("ray*.yaml"))
# Every YAML that configures where Ray or Serve listens: the cluster files and the jobs' configs.
ALL_YAML = sorted({*CLUSTERS.rglob("*.yaml"), *(repo_root() / "jobs" / "configs").glob("*.yaml")})
SERVE_IMPORT_PATH = "speed.serve.app:build_app"


def project_dependencies() -> list[str]:
    """The ``[project] dependencies`` of pyproject.toml (tomllib is not in Python 3.10)."""
    block = re.search(r"^dependencies = \[(.*?)^\]", (repo_root() / "pyproject.toml").read_text(), re.M | re.S)
    return re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)


def pinned_ray_version() -> str:
    (pin,) = [d for d in project_dependencies() if d.startswith("ray[")]
    return pin.split("==")[1]


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _walk(node: Any, path: str = ""):
    """Every (dotted key path, value) pair of a YAML tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield f"{path}[{i}]", value
            yield from _walk(value, f"{path}[{i}]")


def public_exposures(doc: dict[str, Any], pod_network: bool = False) -> list[str]:
    """What in one YAML document would open Ray's or Serve's ports beyond the cluster (empty: nothing).

    ``pod_network``: the document configures processes inside KubeRay pods, where every interface is the
    pod network behind a ClusterIP service, so Serve may listen on 0.0.0.0 there.
    """
    found = []
    if doc.get("kind") in ("Ingress", "Route", "Gateway", "HTTPRoute"):
        found.append(f"a {doc['kind']}")
    for key, value in _walk(doc):
        name = key.rsplit(".", 1)[-1]
        if name in ("type", "serviceType") and value in ("LoadBalancer", "NodePort"):
            found.append(f"{key}: {value}")
        elif (name == "hostNetwork" or name == "enableIngress") and value is True:
            found.append(f"{key}: true")
        elif name == "hostPort":
            found.append(f"{key}: {value}")
        elif isinstance(value, str) and "0.0.0.0/0" in value:
            found.append(f"{key}: {value}")  # an address range open to the internet (security groups, firewalls)
        elif isinstance(value, str) and "ray start" in value and "0.0.0.0" in value:
            found.append(f"{key}: {value}")  # a node's dashboard, client or GCS bound to every interface
        elif name == "http_options" and isinstance(value, dict) and value.get("host") == "0.0.0.0" and not pod_network:
            found.append(f"{key}.host: 0.0.0.0")
        elif name == "serveConfigV2":
            found += [f"{key}: {e}" for e in public_exposures(yaml.safe_load(value), pod_network=True)]
    return found


def _cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]
    return {"RayCluster": spec, "RayJob": spec.get("rayClusterSpec"), "RayService": spec.get("rayClusterConfig")}[
        doc["kind"]
    ]


def _pip_lists() -> dict[str, list[str]]:
    """Every dependency list handed to Ray's runtime environments in clusters/kuberay."""
    lists = {"runtime_env.yaml": yaml.safe_load((CLUSTERS / "kuberay" / "runtime_env.yaml").read_text())["pip"]}
    for path in KUBERAY_FILES:
        for doc in _docs(path):
            if doc["kind"] == "RayJob":
                lists[path.name] = yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["pip"]
            if doc["kind"] == "RayService":
                for app in yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]:
                    lists[f"{path.name}:{app['name']}"] = app["runtime_env"]["pip"]
    return lists


def test_the_pin_is_the_installed_ray():
    assert pinned_ray_version() == ray.__version__


def validate_launcher_config(config: dict) -> None:
    """What `ray up` checks before it launches anything, through Ray's exported pieces: the provider's defaults
    filled in (``ray.autoscaler.sdk.fillout_defaults``), then the cluster schema Ray ships beside its autoscaler."""
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(fillout_defaults(config), schema)


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_launcher_config_passes_rays_validation_with_token_auth_and_a_loopback_dashboard(path):
    config = yaml.safe_load(path.read_text())
    validate_launcher_config(config)
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    ray_starts = [c for c in starts if "ray start" in c]
    assert len(ray_starts) == 2 and all("RAY_AUTH_MODE=token ray start" in c for c in ray_starts)
    (head,) = [c for c in ray_starts if "--head" in c]
    assert re.search(r"--dashboard-host[= ]127\.0\.0\.1\b", head)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # every node gets the token


def test_a_broken_launcher_config_fails_validation():
    config = yaml.safe_load(LAUNCHER_FILES[0].read_text())
    config["available_node_types"]["head"]["min_wrokers"] = 1
    with pytest.raises(Exception, match="min_wrokers"):
        validate_launcher_config(config)


def test_kuberay_manifests_have_the_fields_kuberay_expects_and_our_ray():
    version = pinned_ray_version()
    kinds = {}
    for path in KUBERAY_FILES:
        for doc in _docs(path):
            assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"], path
            kinds[doc["kind"]] = doc
            spec = _cluster_spec(doc)
            assert spec["rayVersion"] == version, path
            assert spec["authOptions"] == {"mode": "token", "secretName": "speed-ray-token"}, path
            head = spec["headGroupSpec"]
            assert head.get("serviceType", "ClusterIP") == "ClusterIP" and "rayStartParams" in head
            templates = [head["template"]]
            assert spec["workerGroupSpecs"], path
            for group in spec["workerGroupSpecs"]:
                assert group["groupName"] and "rayStartParams" in group
                assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], (path, group["groupName"])
                templates.append(group["template"])
            for template in templates:
                containers = template["spec"]["containers"]
                assert containers and all(c["name"] and c["resources"]["limits"] for c in containers)
                for image in (c["image"] for c in containers):
                    name, tag = image.rsplit(":", 1)
                    assert name == "rayproject/ray" and tag.split("-")[0] == version, (path, image)
    assert sorted(kinds) == ["RayCluster", "RayJob", "RayService"]
    job = kinds["RayJob"]
    # Interactive: `kubectl ray job submit -f rayjob.yaml --working-dir . -- python jobs/pretrain.py ...` uploads
    # this checkout; the usage in the file's header is that command.
    assert job["spec"]["submissionMode"] == "InteractiveMode" and "backoffLimit" not in job["spec"]
    header = (CLUSTERS / "kuberay" / "rayjob.yaml").read_text().split("apiVersion")[0]
    assert "kubectl ray job submit -f clusters/kuberay/rayjob.yaml --working-dir . --" in header
    assert "python jobs/pretrain.py" in header
    (app,) = yaml.safe_load(kinds["RayService"]["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == SERVE_IMPORT_PATH and app["args"]["checkpoint"]
    assert all(m.startswith(("s3://", "gs://", "https://")) for m in app["runtime_env"]["py_modules"])


def test_the_rayservice_pods_read_the_api_key_from_a_secret():
    from speed.serve.auth import API_KEY_ENV

    (doc,) = _docs(CLUSTERS / "kuberay" / "rayservice.yaml")
    spec = _cluster_spec(doc)
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for container in (c for t in templates for c in t["spec"]["containers"]):
        (env,) = [e for e in container["env"] if e["name"] == API_KEY_ENV]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "speed-api-key", "key": "api_key"}, container["name"]
    assert "kubectl create secret generic speed-api-key" in (CLUSTERS / "kuberay" / "rayservice.yaml").read_text()


def test_the_rayservice_replicas_spool_statistics_on_a_pod_volume():
    """Where the replicas run (the workers: the head has no CPUs) ``$SPEED_SPOOL_DIR`` is an ``emptyDir`` volume,
    which a container's restart keeps (the rows of a replica killed hard wait there for their upload)."""
    from speed.paths import SPOOL_DIR_ENV

    (doc,) = _docs(CLUSTERS / "kuberay" / "rayservice.yaml")
    spec = _cluster_spec(doc)
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            (env,) = [e for e in container["env"] if e["name"] == SPOOL_DIR_ENV]
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["value"]]
            assert volumes[mount["name"]] == {"name": mount["name"], "emptyDir": {}}, container["name"]


def test_the_serve_import_path_exists():
    module, attr = SERVE_IMPORT_PATH.split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_runtime_env_dependencies_are_the_project_pins():
    wanted = sorted(d for d in project_dependencies() if not d.startswith("ray["))
    assert len(wanted) >= 9 and "torch>=2.4,<2.14" in wanted
    for name, pip in _pip_lists().items():
        assert sorted(pip) == wanted, name


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(repo_root())))
def test_no_file_opens_rays_ports_to_the_internet(path):
    for doc in _docs(path):
        assert public_exposures(doc) == [], path


def test_the_exposure_check_catches_open_ports():
    service = {"kind": "Service", "spec": {"type": "LoadBalancer", "ports": [{"port": 8265}]}}
    launcher = {"head_start_ray_commands": ["ray start --head --dashboard-host=0.0.0.0"]}
    aws = {
        "provider": {"security_group": {"IpPermissions": [{"FromPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]}}
    }
    serve = {"http_options": {"host": "0.0.0.0", "port": 8000}}
    cluster = {"kind": "RayCluster", "spec": {"headGroupSpec": {"serviceType": "NodePort", "enableIngress": True}}}
    service_v2 = {"kind": "RayService", "spec": {"serveConfigV2": "applications: []\nhttp_options: {host: 0.0.0.0}\n"}}
    for doc in (service, launcher, aws, serve, {"kind": "Ingress"}):
        assert len(public_exposures(doc)) == 1, doc
    assert len(public_exposures(cluster)) == 2
    assert public_exposures(service_v2) == []  # the pod network behind a ClusterIP service
