"""deploy/: the Compose, Kubernetes and Slurm recipes start, speak only TLS, and agree on versions.

Docker does not run here, so the Compose services' own commands run as local processes: service
names in addresses become 127.0.0.1, published ports free local ports, the certificates' mount
point a directory the project's `daskdag certs` command fills, and each process binds 127.0.0.1
(in Compose each container binds its own address). Nothing else of a command is changed, so a
command that would not start a working TLS cluster fails here.

GPU workers run JAX on the CPU while advertising GPU=1. On a machine with an NVIDIA GPU and JAX's
CUDA build, ``DASKDAG_TEST_REAL_GPU=1`` keeps their ``JAX_PLATFORMS=cuda`` and checks that the
GPU-marked nodes ran on a GPU (set ``JAX_DEFAULT_MATMUL_PRECISION=highest`` and
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` too).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path

import distributed
import jax
import jax.numpy as jnp
import pytest
import yaml
from distributed import Client, Security
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import daskdag
from daskdag import Node
from daskdag.cli import security

from .support.clusters import free_port, live_workers
from .support.numbers import assert_tree_close

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
GUIDE = REPO / "docs" / "guides" / "deployment.md"
K8S = DEPLOY / "kubernetes"
DASK = shutil.which("dask", path=str(Path(sys.executable).parent)) or shutil.which("dask")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
REAL_GPU = os.environ.get("DASKDAG_TEST_REAL_GPU") == "1"
TLS_FLAGS = ("--tls-ca-file", "--tls-cert", "--tls-key")
CERT_FILES = ("ca.pem", "cert.pem", "key.pem")


# ---------------------------------------------------------------------------------------------
# Shared pieces: certificates from the project's command, the recipes as data, a DAG to check.

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Certificates made the documented way: ``python -m daskdag.cli certs DIR``."""
    d = tmp_path_factory.mktemp("certs")
    subprocess.run([sys.executable, "-m", "daskdag.cli", "certs", str(d), "--force"], check=True,
                   env=_env(), capture_output=True, timeout=60)
    assert sorted(p.name for p in d.iterdir()) == sorted(CERT_FILES)
    assert (d / "key.pem").stat().st_mode & 0o077 == 0  # the key is its owner's alone
    return d


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _env(extra=None):
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _dockerfile_stages() -> dict[str, str]:
    """``{stage name: FROM image}`` of deploy/Dockerfile, ARG defaults substituted."""
    text = (DEPLOY / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    stages = {}
    for image, name in re.findall(r"^FROM (\S+) AS (\S+)", text, re.M):
        stages[name] = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image)
    return stages


def _gpu_dag():
    """A DAG whose nodes G and H must run on a GPU worker (the resource: the test's workers
    have no GPU device), and its gradient in plain JAX."""
    dag = {"A": (lambda x: jnp.tanh(x) * 2, ["x"]),
           "G": Node(lambda a: jnp.sin(a) @ jnp.ones((5, 5)), ["A"], resources={"GPU": 1}),
           "H": Node(lambda g: g ** 2, ["G"], resources={"GPU": 1}),
           "D": (lambda h, a: jnp.sum(h * a), ["H", "A"]),
           "E": (lambda g: jnp.sum(g), ["G"])}

    def D(x):
        a = jnp.tanh(x) * 2
        return jnp.sum((jnp.sin(a) @ jnp.ones((5, 5))) ** 2 * a)

    return dag, D


def _run_gpu_dag(client, gpu_worker):
    """compute_grads through ``client``; checks gradients and that G and H ran on ``gpu_worker``."""
    dag, D = _gpu_dag()
    x = jnp.linspace(-1.0, 2.0, 5)
    with distributed.get_task_stream(client) as ts:
        res = daskdag.compute_grads(dag, x, ["D", "E"], client=client)
    assert_tree_close(res["D"].grad, jax.grad(D)(x), rtol=1e-4)
    assert_tree_close(res["D"].value, D(x), rtol=1e-4)

    # The tasks that need a GPU: those of the graph's layers that ask for one (the same call,
    # not computed: it has the same content keys).
    with client.as_current():
        layers = daskdag.grads(dag, x, ["D", "E"]).__dask_graph__().layers.values()
    needs_gpu = {k for layer in layers
                 if "GPU" in ((layer.annotations or {}).get("resources") or {}) for k in layer}
    placed = [t for t in ts.data if t["key"] in needs_gpu]
    assert len(placed) >= 2 * 3  # G's and H's forward passes, values and backward passes
    assert {t["worker"] for t in placed} == {gpu_worker}
    platform = client.run(lambda: jax.devices()[0].platform, workers=[gpu_worker])[gpu_worker]
    assert platform == ("gpu" if REAL_GPU else "cpu")


def _parse_worker_args(args):
    """Parse ``dask worker`` arguments with the installed distributed's own command line."""
    from distributed.cli.dask_worker import main as worker_cli

    return worker_cli.make_context("dask worker", list(args), resilient_parsing=False).params


def _parse_scheduler_args(args):
    from distributed.cli.dask_scheduler import main as scheduler_cli

    return scheduler_cli.make_context("dask scheduler", list(args), resilient_parsing=False).params


# ---------------------------------------------------------------------------------------------
# Extra packages: wheels this module writes itself (no index, no build backend), a package the
# images and the test's own environment lack, and the images' entrypoint that installs them.

PROBE = "daskdag_extra_probe"
PROBE_SOURCE = """\
import jax.numpy as jnp


def bump(a):
    return jnp.sin(a) * 3.0
"""
# A node of user code that imports the extra package in its body. It is built from source in a
# namespace no worker can import, so it travels pickled by value, as a user's own function does.
NODE_SOURCE = """\
def uses_probe(a):
    import daskdag_extra_probe

    return daskdag_extra_probe.bump(a)
"""


def _by_value(source: str, name: str):
    namespace = {"__name__": "daskdag_test_nodes_not_importable"}
    exec(compile(source, "<node>", "exec"), namespace)
    return namespace[name]


def _make_wheel(directory: Path, name: str, files: Mapping[str, str], requires=()) -> Path:
    """A pure-Python wheel, version 0.1, written by hand (a zip with METADATA, WHEEL, RECORD)."""
    dist, version = name.replace("-", "_"), "0.1"
    info = f"{dist}-{version}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
    return path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """A directory of wheels: the probe package, and one that asks for another dask."""
    d = tmp_path_factory.mktemp("wheels")
    _make_wheel(d, "daskdag-extra-probe", {f"{PROBE}/__init__.py": PROBE_SOURCE})
    _make_wheel(d, "daskdag-extra-pin", {"daskdag_extra_pin/__init__.py": ""},
                requires=["dask==2020.1.0"])
    return d


def _entrypoint() -> list[str]:
    """deploy/Dockerfile's ENTRYPOINT, its script mapped from the image to this checkout."""
    text = (DEPLOY / "Dockerfile").read_text()
    (line,) = re.findall(r"^ENTRYPOINT (.*)$", text, re.M)
    entry = json.loads(line)
    (workdir,) = set(re.findall(r"^WORKDIR (/opt/\S+)$", text, re.M))
    assert entry[0].startswith(workdir + "/"), entry
    script = entry[0][len(workdir) + 1:]
    assert re.search(rf"^COPY (--chmod=0?755 )?{re.escape(script)} {re.escape(script)}$", text, re.M)
    local = REPO / script
    assert local.is_file() and os.access(local, os.X_OK), local
    return [str(local), *entry[1:]]


def _container_env(site: Path, extra=None) -> dict[str, str]:
    """A container's view, as far as pip goes: its own site directory for what it installs
    (the image's ~/.local), this environment's python, and no package index (offline)."""
    env = _env(extra)
    env["PIP_TARGET"] = str(site)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PIP_NO_INDEX"] = "1"
    return env


@pytest.mark.subprocess
def test_the_entrypoint_installs_extra_packages_within_the_pins_and_fails_loudly(wheels, tmp_path):
    """deploy/prepare.sh as the images run it: EXTRA_PIP_PACKAGES installed with the image's
    constraints, then the command in its place, its arguments untouched; a package pip cannot
    install, or one that would move a pinned version, stops the container with a message."""
    entry = _entrypoint()
    show_argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME", "*", ""]

    def run(site, env, *command):
        return subprocess.run([*entry, *command], env=_container_env(tmp_path / site, {
            "PIP_FIND_LINKS": str(wheels), **env}), capture_output=True, text=True, timeout=120)

    # Nothing asked: the command runs as given.
    out = run("none", {"EXTRA_PIP_PACKAGES": ""}, *show_argv)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(["a b", "$HOME", "*", ""])
    assert "installing" not in out.stderr

    # Requirements with extras and specifiers (not file patterns), and a wheel's path.
    probe = f"import {PROBE}, sys; print({PROBE}.__file__)"
    for site, packages in (("req", "daskdag-extra-probe[any]>=0.1 daskdag-extra-probe"),
                           ("wheel", str(wheels / f"{PROBE}-0.1-py3-none-any.whl"))):
        out = run(site, {"EXTRA_PIP_PACKAGES": packages}, sys.executable, "-c", probe)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(str(tmp_path)), out.stdout  # from the container's site
    assert importlib.util.find_spec(PROBE) is None  # and not into this environment

    # Failures: nonzero, the packages named, the command not run.
    marker = tmp_path / "ran"
    for packages, why in (("daskdag-no-such-package", "No matching distribution"),
                          ("daskdag-extra-pin", "(constraint) dask==")):
        out = run("fail", {"EXTRA_PIP_PACKAGES": packages}, "touch", str(marker))
        assert out.returncode != 0
        assert f'pip could not install EXTRA_PIP_PACKAGES="{packages}"' in out.stderr, out.stderr
        assert why in out.stderr, out.stderr
        assert not marker.exists()
    for var in ("EXTRA_APT_PACKAGES", "EXTRA_CONDA_PACKAGES"):
        out = run("fail", {var: "libfoo"}, "touch", str(marker))
        assert out.returncode == 1 and f'{var}="libfoo" is not supported' in out.stderr
        assert not marker.exists()
    out = run("none", {})
    assert out.returncode == 2 and "no command" in out.stderr


# ---------------------------------------------------------------------------------------------
# Docker Compose

def _environment(service) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _interpolate(value: str, host_env: Mapping[str, str]) -> str:
    """Compose's interpolation of ``${VAR}``, ``${VAR:-default}`` and ``$$`` from the
    environment of ``docker compose up``."""
    def sub(m):
        if m[0] == "$$":
            return "$"
        return host_env.get(m["name"]) or (m["default"] or "")

    return re.sub(r"\$\$|\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}", sub, value)


class LocalCompose:
    """deploy/compose.yaml's services as local processes (see the module docstring)."""

    def __init__(self, compose, certs: Path, logs: Path, sites: Path,
                 host_env: Mapping[str, str] | None = None):
        self.services = compose["services"]
        self.certs, self.logs, self.sites = certs, logs, sites
        self.host_env = dict(host_env or {})  # the environment of `docker compose up`
        self.ports = {}  # published container port -> free local port
        for s in self.services.values():
            for p in s.get("ports", []):
                self.ports[int(str(p).split(":")[-1].split("/")[0])] = free_port()
        self.mounts = set()  # where the certificates are mounted in the containers
        for s in self.services.values():
            for v in s.get("volumes", []):
                source, target, *mode = str(v).split(":")
                if (DEPLOY / source).resolve() == (DEPLOY / "certs").resolve():
                    self.mounts.add(target)
        self.procs: list[subprocess.Popen] = []

    def localize(self, token: str) -> str:
        for target in self.mounts:
            if token == target or token.startswith(target + "/"):
                token = str(self.certs) + token[len(target):]
        names = "|".join(map(re.escape, self.services))
        token = re.sub(rf"(?<=://)({names})(?=:\d)", "127.0.0.1", token)
        m = re.fullmatch(r"(|.*:)(\d+)", token)
        if m and int(m[2]) in self.ports:
            token = ("127.0.0.1:" if m[1] == ":" else m[1]) + str(self.ports[int(m[2])])
        return token

    def command(self, name) -> list[str]:
        """The service's command, run through the images' entrypoint (deploy/prepare.sh)."""
        cmd = self.services[name]["command"]
        assert isinstance(cmd, list) and cmd[0] == "dask", f"{name}: command must be a list [dask, ...]"
        return (_entrypoint() + [DASK] + [self.localize(str(t)) for t in cmd[1:]]
                + ["--host", "127.0.0.1"])

    def environment(self, name, site: Path) -> dict[str, str]:
        env = {k: self.localize(_interpolate(v, self.host_env))
               for k, v in _environment(self.services[name]).items()}
        if not REAL_GPU:
            env["JAX_PLATFORMS"] = "cpu"  # the GPU worker too: a CPU process advertising GPU=1
        return _container_env(site, env)

    def start(self, name) -> None:
        for i in range(self.services[name].get("deploy", {}).get("replicas", 1)):
            log = open(self.logs / f"{name}-{i}.log", "w")
            env = self.environment(name, self.sites / f"{name}-{i}")  # each container its own
            self.procs.append(subprocess.Popen(self.command(name), env=env,
                                               stdout=log, stderr=subprocess.STDOUT))
            log.close()

    def output(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.iterdir()))

    def stop(self) -> None:
        """Workers first, so that they leave a scheduler that still answers, then the scheduler."""
        for group in (self.procs[1:], self.procs[:1]):
            for p in group:
                p.terminate()
            for p in group:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture(scope="module")
def compose_cluster(compose, certs, wheels, tmp_path_factory):
    """Every Compose service started locally, with ``EXTRA_PIP_PACKAGES`` set to the probe's
    wheel, as ``EXTRA_PIP_PACKAGES=... docker compose up`` would; yields (scheduler address,
    LocalCompose)."""
    probe = wheels / f"{PROBE}-0.1-py3-none-any.whl"
    local = LocalCompose(compose, certs, tmp_path_factory.mktemp("compose-logs"),
                         tmp_path_factory.mktemp("compose-sites"),
                         host_env={"EXTRA_PIP_PACKAGES": str(probe)})
    address = f"tls://127.0.0.1:{local.ports[8786]}"
    try:
        local.start("scheduler")
        deadline = time.time() + 60
        while True:
            with closing(socket.socket()) as s:
                if s.connect_ex(("127.0.0.1", local.ports[8786])) == 0:
                    break
            assert local.procs[0].poll() is None, f"the scheduler exited:\n{local.output()}"
            assert time.time() < deadline, f"the scheduler did not listen:\n{local.output()}"
            time.sleep(0.2)
        for name in local.services:
            if name != "scheduler":
                local.start(name)
        n = len(local.procs) - 1
        with Client(address, security=security(certs), timeout=60, set_as_default=False) as client:
            deadline = time.time() + 60
            while len(live_workers(client)) < n:
                exited = [p.args[2:4] for p in local.procs if p.poll() is not None]
                assert not exited, f"{exited} exited:\n{local.output()}"
                assert time.time() < deadline, f"{n} workers did not connect:\n{local.output()}"
                time.sleep(0.3)
        yield address, local
    finally:
        local.stop()


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_compose_services_start_and_compute_gradients_over_tls(compose_cluster, certs):
    address, local = compose_cluster
    with Client(address, security=security(certs), timeout=30, set_as_default=False) as client:
        workers = live_workers(client)
        assert len(workers) == sum(s.get("deploy", {}).get("replicas", 1)
                                   for n, s in local.services.items() if n != "scheduler")
        assert all(a.startswith("tls://") for a in workers)  # workers listen over TLS too
        gpu = [a for a, w in workers.items() if w.get("resources") == {"GPU": 1}]
        assert len(gpu) == 1, {a: w.get("resources") for a, w in workers.items()}
        assert all(not w.get("resources") for a, w in workers.items() if a not in gpu)
        _run_gpu_dag(client, gpu[0])

    # The published dashboard port serves HTTPS with the cluster's certificate.
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    url = f"https://localhost:{local.ports[8787]}/health"
    assert urllib.request.urlopen(url, context=ctx, timeout=10).read() == b"ok"


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_compose_workers_install_extra_pip_packages_for_user_nodes(compose_cluster, certs):
    """A node whose function imports a package that neither the image nor the client has: the
    workers installed it at start from EXTRA_PIP_PACKAGES (compose.yaml), and gradients agree
    with plain JAX."""
    address, local = compose_cluster
    assert importlib.util.find_spec(PROBE) is None  # the client does not have it
    node = _by_value(NODE_SOURCE, "uses_probe")
    dag = {"A": (lambda x: jnp.tanh(x), ["x"]),
           "B": (node, ["A"]),
           "D": (lambda b, a: jnp.sum(b * a), ["B", "A"]),
           "E": (lambda b: jnp.sum(b ** 2), ["B"])}

    def D(x):
        a = jnp.tanh(x)
        return jnp.sum(jnp.sin(a) * 3.0 * a)

    def E(x):
        return jnp.sum((jnp.sin(jnp.tanh(x)) * 3.0) ** 2)

    x = jnp.linspace(-1.0, 2.0, 5)
    with Client(address, security=security(certs), timeout=30, set_as_default=False) as client:
        installed = client.run(lambda: importlib.util.find_spec(PROBE).origin)
        assert len(installed) == len(live_workers(client))
        assert all(o.startswith(str(local.sites)) for o in installed.values()), installed
        res = daskdag.compute_grads(dag, x, ["D", "E"], client=client)
    assert_tree_close(res["D"].grad, jax.grad(D)(x), rtol=1e-5)
    assert_tree_close(res["E"].grad, jax.grad(E)(x), rtol=1e-5)
    assert_tree_close(res["D"].value, D(x), rtol=1e-5)


async def _identity(address, security=None):
    """Connect as a Dask client does (TLS handshake, then Dask's handshake) and ask who is there."""
    args = security.get_connection_args("client") if security else {}
    comm = await distributed.comm.connect(address, timeout=5, **args)
    try:
        await comm.write({"op": "identity", "reply": True})
        return await comm.read()
    finally:
        await comm.close()


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_scheduler_refuses_clients_without_the_certificates(compose_cluster, certs):
    address, local = compose_cluster
    port = local.ports[8786]

    # A TLS connection that trusts the cluster's CA but shows no certificate: the scheduler
    # aborts it (TLS 1.3 reports that on the first read). With the certificate, the same
    # connection receives the scheduler's first Dask message.
    def first_byte(cert: bool) -> bytes:
        ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        ctx.check_hostname = False
        if cert:
            ctx.load_cert_chain(certs / "cert.pem", certs / "key.pem")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                return tls.recv(1)

    with pytest.raises((ssl.SSLError, ConnectionError)):
        if not first_byte(cert=False):
            raise ConnectionError("closed by the scheduler")
    assert first_byte(cert=True)

    # A client showing a certificate that another CA signed (and trusting ours): refused.
    other = Security.temporary()
    foreign = Security(tls_ca_file=str(certs / "ca.pem"), tls_client_cert=other.tls_client_cert,
                       tls_client_key=other.tls_client_key, require_encryption=True)
    with pytest.raises(OSError):  # SSLError, or the connection closed under the handshake
        asyncio.run(_identity(address, foreign))

    # A plain TCP client on the same port: refused.
    with pytest.raises(OSError):
        asyncio.run(_identity(address.replace("tls://", "tcp://")))

    # A client without any TLS settings cannot even address the cluster.
    with pytest.raises((TypeError, OSError)):
        asyncio.run(_identity(address))

    # With the certificates: the scheduler answers, and a Client gets correct gradients.
    assert asyncio.run(_identity(address, security(certs)))["type"] == "Scheduler"
    with Client(address, security=security(certs), timeout=30, set_as_default=False) as client:
        gpu = next(a for a, w in live_workers(client).items()
                   if w.get("resources") == {"GPU": 1})
        _run_gpu_dag(client, gpu)


def test_compose_file_is_tls_only_gpu_ready_and_matches_the_images(compose):
    services = compose["services"]
    stages = _dockerfile_stages()
    assert {"scheduler", "worker-gpu"} <= set(services) and len(services) >= 3

    for name, s in services.items():
        cmd = [str(t) for t in s["command"]]
        assert cmd[:2] in (["dask", "scheduler"], ["dask", "worker"]), name
        for flag in TLS_FLAGS:  # each TLS option, pointing into the read-only certificates mount
            value = cmd[cmd.index(flag) + 1]
            assert value.startswith("/certs/") and Path(value).name in CERT_FILES, (name, flag)
        assert "./certs:/certs:ro" in s["volumes"], name
        assert _environment(s)["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"].lower() == "true"
        # Images: CPU or GPU target of deploy/Dockerfile, tagged with daskdag's version.
        build = s["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        assert build["target"] in stages, name
        assert s["image"] == f"daskdag:{VERSION}" + ("-gpu" if build["target"] == "gpu" else "")
        if cmd[1] == "worker":
            assert cmd[2] == "tls://scheduler:8786", name

    scheduler = [str(t) for t in services["scheduler"]["command"]]
    assert scheduler[scheduler.index("--port") + 1] == "8786"
    assert scheduler[scheduler.index("--protocol") + 1] == "tls"
    dashboard = scheduler[scheduler.index("--dashboard-address") + 1]
    ports = [str(p) for p in services["scheduler"]["ports"]]
    assert "8786:8786" in ports
    assert f"127.0.0.1:{dashboard.split(':')[-1]}:{dashboard.split(':')[-1]}" in ports
    env = _environment(services["scheduler"])
    assert env["DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__CERT"] == "/certs/cert.pem"

    # Exactly the GPU service advertises GPU=1 and reserves an NVIDIA GPU.
    for name, s in services.items():
        cmd = [str(t) for t in s["command"]]
        gpu = "--resources" in cmd and cmd[cmd.index("--resources") + 1] == "GPU=1"
        assert gpu == (name == "worker-gpu"), name
        assert (s["build"]["target"] == "gpu") == gpu, name
    devices = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert _environment(services["worker-gpu"])["JAX_PLATFORMS"] == "cuda"


# ---------------------------------------------------------------------------------------------
# Versions and images

def _pins() -> dict[str, str]:
    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower()] = spec.version
    return pins


def test_the_recipes_are_described_in_one_place():
    """The deployment guide is the recipes' one description: deploy/README.md lists the files
    and links to it, with no commands of its own to drift apart from the guide's."""
    readme = (DEPLOY / "README.md").read_text()
    assert "](../docs/guides/deployment.md)" in readme
    assert "```" not in readme
    listed = set(re.findall(r"^\| `([^`]+?)/?` \|", readme, re.M))
    assert listed == {p.name for p in DEPLOY.iterdir()
                      if p.name not in ("README.md", "certs") and not p.name.startswith(".")
                      and not p.name.endswith(".dockerignore")}
    guide = GUIDE.read_text()
    assert all(f"`deploy/{name}" in guide for name in listed)


def test_versions_are_pinned_once_and_satisfy_pyproject():
    pins = _pins()
    for name in ("jax", "jaxlib", "dask", "distributed", "cloudpickle"):
        assert name in pins
    assert pins["jax"] == pins["jaxlib"] == pins["jax-cuda13-plugin"] == pins["jax-cuda13-pjrt"]
    assert pins["dask"] == pins["distributed"]

    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    for req in reqs:
        if req.name.lower() in pins:
            assert pins[req.name.lower()] in req.specifier, (req, pins[req.name.lower()])
    for name in ("cryptography", "dask-jobqueue", "bokeh"):  # deploy/ needs them: in an extra
        assert any(r.name.lower() == name for r in reqs), name

    # The Dockerfile pins nothing itself: every pip install goes through the constraints file.
    text = (DEPLOY / "Dockerfile").read_text()
    installs = [ln for ln in text.splitlines() if "pip install" in ln and not ln.startswith("#")]
    assert len(installs) == 2 and all("-c " in i and "constraints.txt" in i for i in installs)
    assert not re.search(r"==\d", text)
    assert re.search(r'pip install [^\n]*"jax\[\$\{JAX_CUDA\}\]"', text)
    assert re.search(r"^ARG JAX_CUDA=cuda13$", text, re.M)
    stages = _dockerfile_stages()
    assert set(stages) == {"cpu", "gpu"} and stages["gpu"] == "cpu"
    python = re.fullmatch(r"python:(\d+\.\d+)-slim", stages["cpu"])[1]
    assert f"{python}.0" in SpecifierSet(project["requires-python"])


# ---------------------------------------------------------------------------------------------
# Kubernetes (dask-kubernetes operator)

def _manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomizeconfig.yaml":  # kustomize's own settings, not a resource
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _secret_mounts(pod_spec) -> dict[str, str]:
    """``{container name: mount path}`` of the TLS Secret in a pod spec."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {}
    for c in pod_spec["containers"]:
        for m in c.get("volumeMounts", []):
            secret = volumes[m["name"]].get("secret")
            if secret:
                assert secret["secretName"] == "daskdag-tls"
                assert secret.get("defaultMode", 0o644) & 0o007 == 0  # not world-readable
                assert m.get("readOnly") is True
                mounts[c["name"]] = m["mountPath"]
    return mounts


def _localized_args(args, mount, certs):
    """Container args with the Secret's mount path pointing at real files, so the installed
    distributed's command line can check them."""
    return [str(certs) + a[len(mount):] if a.startswith(mount + "/") else a for a in args]


@pytest.mark.subprocess
def test_kubernetes_manifests_give_the_operator_what_it_needs(certs):
    docs = _manifests()
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"DaskCluster", "DaskWorkerGroup", "Kustomization"}
    for d in docs:
        if d["kind"].startswith("Dask"):
            assert d["apiVersion"] == "kubernetes.dask.org/v1"
    cluster, gpu_group = kinds["DaskCluster"], kinds["DaskWorkerGroup"]
    name = cluster["metadata"]["name"]
    assert gpu_group["spec"]["cluster"] == name

    # Scheduler: TLS on the port the Service exposes as "tcp-comm" (the operator's name for it).
    sched_spec = cluster["spec"]["scheduler"]["spec"]
    (sched,) = sched_spec["containers"]
    mount = _secret_mounts(sched_spec)[sched["name"]]
    assert sched["args"][:2] == ["dask", "scheduler"]
    params = _parse_scheduler_args(_localized_args(sched["args"][2:], mount, certs))
    assert params["protocol"] == "tls"
    assert {params["tls_ca_file"], params["tls_cert"], params["tls_key"]} == {
        str((certs / f).resolve()) for f in CERT_FILES}
    container_ports = {p["name"]: p["containerPort"] for p in sched["ports"]}
    service = cluster["spec"]["scheduler"]["service"]
    assert service["selector"] == {"dask.org/cluster-name": name, "dask.org/component": "scheduler"}
    svc_ports = {p["name"]: p for p in service["ports"]}
    comm = svc_ports["tcp-comm"]
    assert container_ports[comm["targetPort"]] == int(params["port"]) == comm["port"]
    assert container_ports[svc_ports["http-dashboard"]["targetPort"]] == int(
        params["dashboard_address"].split(":")[-1])
    scheduler_address = f"tls://{name}-scheduler:{comm['port']}"

    # Worker groups: the DaskCluster's default one is CPU, the DaskWorkerGroup is GPU.
    groups = {"cpu": cluster["spec"]["worker"], "gpu": gpu_group["spec"]["worker"]}
    for kind, group in groups.items():
        assert group["replicas"] >= 1
        (c,) = group["spec"]["containers"]
        mount = _secret_mounts(group["spec"])[c["name"]]
        assert c["args"][:2] == ["dask", "worker"]
        params = _parse_worker_args(_localized_args(c["args"][2:], mount, certs))
        assert params["scheduler"] == scheduler_address
        assert {params["tls_ca_file"], params["tls_cert"], params["tls_key"]} == {
            str((certs / f).resolve()) for f in CERT_FILES}
        assert params["name"] == "$(DASK_WORKER_NAME)"  # the pod name: the operator retires by it
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["DASK_SCHEDULER_ADDRESS"] == scheduler_address
        assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "true"
        resources = c["resources"]
        gpus = {k: str(v.get("nvidia.com/gpu")) for k, v in resources.items()}
        if kind == "gpu":
            assert params["resources"] == "GPU=1"
            assert gpus == {"requests": "1", "limits": "1"}
            assert env["JAX_PLATFORMS"] == "cuda"
            assert c["image"] == f"daskdag:{VERSION}-gpu"
        else:
            assert not params["resources"]
            assert gpus == {"requests": "None", "limits": "None"}
            assert env["JAX_PLATFORMS"] == "cpu"
            assert c["image"] == f"daskdag:{VERSION}"
    assert sched["image"] == f"daskdag:{VERSION}"

    # The images are the Compose file's, built from deploy/Dockerfile.
    compose_images = {s["image"] for s in yaml.safe_load(
        (DEPLOY / "compose.yaml").read_text())["services"].values()}
    assert {sched["image"], *(g["spec"]["containers"][0]["image"] for g in groups.values())} == compose_images

    # kustomize: every manifest listed, the image name it rewrites is ours.
    kustomization = kinds["Kustomization"]
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name not in ("kustomization.yaml", "kustomizeconfig.yaml"))
    assert [i["name"] for i in kustomization["images"]] == ["daskdag"]

    # The deployment guide's Secret has the name and keys the pods mount.
    guide = (GUIDE).read_text()
    (create,) = re.findall(r"kubectl create secret generic daskdag-tls(?:\\\n|[^\n])*", guide)
    assert sorted(re.findall(r"--from-file=([\w.]+)=", create)) == sorted(CERT_FILES)


# The Python route (daskdag.deploy.kubernetes, dask-kubernetes' KubeCluster) and the autoscaler.

def _kube():
    pytest.importorskip("dask_kubernetes", reason="the deploy extra (dask-kubernetes) is not installed")
    import daskdag.deploy.kubernetes as kube

    return kube


def test_the_python_route_builds_the_manifests(certs):
    """daskdag.deploy.kubernetes' resources are deploy/kubernetes/'s, field for field, and its
    options change what they name (cluster, Secret, images, workers, environment)."""
    kube = _kube()
    kinds = {d["kind"]: d for d in _manifests()}
    (scaler,) = yaml.safe_load_all((K8S / "autoscaling" / "autoscaler.yaml").read_text())
    assert kube.cluster_spec() == kinds["DaskCluster"]
    assert kube.worker_group("daskdag", "gpu", kube.gpu_worker_spec()) == kinds["DaskWorkerGroup"]
    assert kube.autoscaler("daskdag", 1, 10) == scaler
    with pytest.raises(ValueError):
        kube.autoscaler("daskdag", 5, 2)

    spec = kube.cluster_spec("mine", image="reg/daskdag:0.1.0", certs_secret="mine-tls",
                             n_workers=5, env={"EXTRA_PIP_PACKAGES": "optax"}, scheduler_api=False)
    gpu = kube.gpu_worker_spec("mine", image="reg/daskdag:0.1.0-gpu", certs_secret="mine-tls",
                               n_workers=3)
    assert spec["metadata"]["name"] == "mine" and spec["spec"]["worker"]["replicas"] == 5
    assert gpu["replicas"] == 3
    sched_pod = spec["spec"]["scheduler"]["spec"]
    assert spec["spec"]["scheduler"]["service"]["selector"]["dask.org/cluster-name"] == "mine"
    assert "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES" not in {
        e["name"] for e in sched_pod["containers"][0]["env"]}
    for pod, image in ((sched_pod, "reg/daskdag:0.1.0"), (spec["spec"]["worker"]["spec"], "reg/daskdag:0.1.0"),
                       (gpu["spec"], "reg/daskdag:0.1.0-gpu")):
        (c,) = pod["containers"]
        assert c["image"] == image
        for v in pod["volumes"]:
            v["secret"]["secretName"] = v["secret"]["secretName"].replace("mine-tls", "daskdag-tls")
        mount = _secret_mounts(pod)[c["name"]]
        if c["args"][1] == "worker":
            params = _parse_worker_args(_localized_args(c["args"][2:], mount, certs))
            assert params["scheduler"] == "tls://mine-scheduler:8786"
            assert params["resources"] == ("GPU=1" if pod is gpu["spec"] else None)
    env = {e["name"]: e["value"] for e in spec["spec"]["worker"]["spec"]["containers"][0]["env"]}
    assert env["EXTRA_PIP_PACKAGES"] == "optax"
    assert env["DASK_SCHEDULER_ADDRESS"] == "tls://mine-scheduler:8786"


@pytest.mark.subprocess
def test_only_the_kubernetes_module_imports_dask_kubernetes():
    """dask-kubernetes (and kopf, kr8s, the Kubernetes clients) load for a user who asks for
    daskdag.deploy.kubernetes, not with daskdag or daskdag.deploy."""
    code = ("import sys, daskdag, daskdag.deploy, daskdag.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('dask_kubernetes', 'kopf', 'kr8s', 'kubernetes', 'kubernetes_asyncio')))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_scheduler_serves_the_http_api_the_operator_calls():
    """The manifest's route setting, read as Dask reads the environment: distributed's default
    routes plus its scheduler API (which the operator's autoscaler and scale-down call)."""
    import dask

    env = {e["name"]: e["value"] for e in _manifests()[0]["spec"]["scheduler"]["spec"]["containers"][0]["env"]}
    name = "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"
    routes = dask.config.collect_env({name: env[name]})["distributed"]["scheduler"]["http"]["routes"]
    defaults = yaml.safe_load((Path(distributed.__file__).parent / "distributed.yaml").read_text())
    default_routes = defaults["distributed"]["scheduler"]["http"]["routes"]
    assert routes == [*default_routes, "distributed.http.scheduler.api"]
    for route in routes:
        importlib.import_module(route)
    if importlib.util.find_spec("dask_kubernetes"):
        assert env[name] == _kube().SCHEDULER_API_ENV["value"]


def _crds() -> dict[str, dict]:
    """The operator's CustomResourceDefinitions, as the dask-kubernetes package ships them:
    ``{kind: openAPIV3Schema}``, with the package's own ``$ref`` templates kept for resolving."""
    pytest.importorskip("dask_kubernetes", reason="the deploy extra (dask-kubernetes) is not installed")
    import dask_kubernetes

    d = Path(dask_kubernetes.__file__).parent / "operator" / "customresources"
    crds = {}
    for name in ("daskcluster", "daskworkergroup", "daskautoscaler"):
        crd = yaml.safe_load((d / f"{name}.yaml").read_text())
        assert crd["spec"]["group"] == "kubernetes.dask.org"
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        crds[crd["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    crds["$templates"] = yaml.safe_load((d / "templates.yaml").read_text())["definitions"]
    return crds


def _check_k8s_model(value, type_name: str, path: str, errors: list) -> None:
    """Field names and basic types against the kubernetes client's models (PodSpec, ServiceSpec
    and everything under them): the operator's CRDs point to these Kubernetes schemas."""
    import kubernetes.client as k8s

    m = re.fullmatch(r"List\[(.+)\]", type_name)
    if m:
        if not isinstance(value, list):
            errors.append(f"{path}: a list expected")
            return
        for i, v in enumerate(value):
            _check_k8s_model(v, m[1], f"{path}[{i}]", errors)
        return
    m = re.fullmatch(r"Dict\[str, (.+)\]", type_name)
    if m:
        if not isinstance(value, dict):
            errors.append(f"{path}: a map expected")
            return
        for k, v in value.items():
            _check_k8s_model(v, m[1], f"{path}.{k}", errors)
        return
    simple = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in simple:
        if not isinstance(value, simple[type_name]) or (type_name == "int" and isinstance(value, bool)):
            errors.append(f"{path}: {type_name} expected, got {value!r}")
        return
    model = getattr(k8s, type_name)
    if not isinstance(value, dict):
        errors.append(f"{path}: a {type_name} object expected")
        return
    by_json = {j: a for a, j in model.attribute_map.items()}
    for key, v in value.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            _check_k8s_model(v, model.openapi_types[by_json[key]], f"{path}.{key}", errors)


def _check_crd(value, schema: dict, templates: dict, path: str, errors: list) -> None:
    """A resource against its CRD's structural schema: required fields, types, no unknown fields."""
    ref = schema.get("$ref")
    if ref:
        target = ref.split("#/definitions/")[-1]
        if "k8s_crd_resolver" in ref:  # a Kubernetes schema the package does not ship
            _check_k8s_model(value, "V1" + target.rsplit(".", 1)[-1], path, errors)
            return
        schema = templates[target]
    kind = schema.get("type")
    python = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
    if kind and (not isinstance(value, python[kind]) or (kind == "integer" and isinstance(value, bool))):
        errors.append(f"{path}: {kind} expected, got {value!r}")
        return
    if kind == "object":
        for r in schema.get("required", []):
            if r not in value:
                errors.append(f"{path}.{r}: required")
        props = schema.get("properties")
        if props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            for key, v in value.items():
                if key not in props:
                    errors.append(f"{path}.{key}: not in the CRD")
                else:
                    _check_crd(v, props[key], templates, f"{path}.{key}", errors)
    elif kind == "array" and "items" in schema:
        for i, v in enumerate(value):
            _check_crd(v, schema["items"], templates, f"{path}[{i}]", errors)


def test_manifests_and_python_specs_fit_the_operator_crds():
    """Every resource of deploy/kubernetes/ (the autoscaler's too) and of the Python route, read
    against the CRDs the dask-kubernetes package ships: required fields, types, and no field the
    operator's schema does not have (Kubernetes would prune it silently)."""
    crds = _crds()
    kube = _kube()
    templates = crds.pop("$templates")
    resources = [*_manifests(), *yaml.safe_load_all((K8S / "autoscaling" / "autoscaler.yaml").read_text()),
                 kube.cluster_spec("x", scheduler_api=False), kube.autoscaler("x", 0, 3),
                 kube.worker_group("x", "gpu", kube.gpu_worker_spec("x", n_workers=2))]
    checked = set()
    for r in resources:
        if r["kind"] == "Kustomization":
            continue
        assert r["apiVersion"] == "kubernetes.dask.org/v1"
        errors: list[str] = []
        body = {k: v for k, v in r.items() if k not in ("apiVersion", "kind", "metadata")}
        _check_crd(body, crds[r["kind"]], templates, r["kind"], errors)
        assert not errors, errors
        checked.add(r["kind"])
    assert checked == {"DaskCluster", "DaskWorkerGroup", "DaskAutoscaler"}

    # The checker does catch a misspelt field, a wrong type and a missing one.
    bad = {"spec": {"cluster": "x", "minimum": "1", "maximun": 3}}
    errors = []
    _check_crd(bad, crds["DaskAutoscaler"], templates, "DaskAutoscaler", errors)
    assert sorted(errors) == ["DaskAutoscaler.spec.maximum: required",
                              "DaskAutoscaler.spec.maximun: not in the CRD",
                              "DaskAutoscaler.spec.minimum: integer expected, got '1'"]
    bad = kube.cluster_spec("x")
    bad["spec"]["worker"]["spec"]["containers"][0]["volumeMount"] = []
    errors = []
    _check_crd({"spec": bad["spec"]}, crds["DaskCluster"], templates, "DaskCluster", errors)
    assert errors == ["DaskCluster.spec.worker.spec.containers[0].volumeMount: not a field of V1Container"]


class _FakeKube:
    """The Kubernetes API as KubeCluster sees it (dask-kubernetes' resource classes and its
    networking helpers), recording what it is asked to create; the "scheduler pod" is a local
    TLS scheduler."""

    def __init__(self, scheduler_port: int, dashboard_port: int, existing: dict | None = None):
        import box
        import kr8s

        self.created: list[dict] = []
        self.deleted: list[str] = []
        fake = self

        class Resource:
            def __init__(self, data, namespace=None, **kwargs):
                self.data, self.namespace, self.raw = data, namespace, {}

            def __await__(self):
                async def ready():
                    return self

                return ready().__await__()

            @classmethod
            async def get(cls, name=None, namespace=None, **kwargs):
                if cls.__name__ != "DaskCluster":
                    raise kr8s.NotFoundError(name)
                found = cls(name, namespace)
                if existing is not None:  # what the API server holds: a DaskCluster applied
                    found.name, found.spec = name, box.Box(existing["spec"])
                    found.replicas = existing["spec"]["worker"]["replicas"]
                return found

            async def exists(self):
                return existing is not None

            async def ready(self):
                return True

            async def create(self):
                fake.created.append(self.data)

            async def patch(self, *args, **kwargs):
                raise kr8s.NotFoundError(self.data)

            async def delete(self):
                fake.deleted.append(self.data if isinstance(self.data, str) else self.data["metadata"]["name"])

        self.classes = {n: type(n, (Resource,), {}) for n in
                        ("DaskCluster", "DaskWorkerGroup", "DaskAutoscaler", "Pod", "Service")}

        async def nothing(*args, **kwargs):
            return None

        async def address(service, namespace, port_name="tcp-comm", **kwargs):
            # The operator's answer: tcp://, whatever the scheduler speaks.
            return f"tcp://127.0.0.1:{scheduler_port if port_name == 'tcp-comm' else dashboard_port}"

        self.functions = {"wait_for_scheduler": nothing, "wait_for_service": nothing,
                          "get_scheduler_address": address}

    def install(self, monkeypatch, module) -> None:
        for name, value in {**self.classes, **self.functions}.items():
            monkeypatch.setattr(module, name, value)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_make_cluster_and_from_name_connect_over_tls(certs, monkeypatch):
    """make_cluster through KubeCluster's own code, against a stand-in for the Kubernetes API and
    a real TLS scheduler: the resources it creates are the Python route's (the DaskCluster, the
    GPU worker group, the autoscaler of adapt), it speaks TLS to the scheduler the operator names
    with tcp://, a Client(cluster) computes correct gradients, and close() deletes the cluster;
    from_name connects to one that exists. KubeCluster alone, with no TLS connection arguments,
    waits forever on such a scheduler."""
    kube = _kube()
    import dask_kubernetes.operator.kubecluster.kubecluster as kc
    from distributed import LocalCluster

    servers = security(certs, roles=("scheduler", "worker", "client"))
    with LocalCluster(n_workers=1, processes=False, protocol="tls://", security=servers,
                      dashboard_address="127.0.0.1:0", scheduler_sync_interval=3600) as local:
        # A scheduler the operator started has no cluster manager's record yet (KubeCluster
        # would take this LocalCluster's name from it), and no cluster object watching its
        # workers (the scheduler keeps one such watch, and warns when a second replaces it).
        local.scheduler.task_metadata.pop("cluster-manager-info", None)
        local.scheduler.remove_plugin(name="worker-status")
        port = int(local.scheduler_address.rsplit(":", 1)[1])
        fake = _FakeKube(port, local.scheduler.http_server.port)
        fake.install(monkeypatch, kc)
        original_rpc = kc.rpc
        cluster = kube.make_cluster("daskdag", certs=certs, namespace="test", n_workers=3,
                                    gpu_workers=2, adapt=(1, 6), quiet=True,
                                    env={"EXTRA_PIP_PACKAGES": "optax"})
        try:
            assert cluster.scheduler_address == local.scheduler_address
            assert cluster.security.require_encryption
            dag = {"A": (lambda x: jnp.tanh(x) * 2, ["x"]), "D": (lambda a: jnp.sum(a ** 2), ["A"])}
            x = jnp.linspace(-1.0, 2.0, 5)
            with Client(cluster, set_as_default=False) as client:
                res = daskdag.compute_grads(dag, x, ["D"], client=client)
            assert_tree_close(res["D"].grad, jax.grad(lambda x: jnp.sum((jnp.tanh(x) * 2) ** 2))(x),
                              rtol=1e-5)
        finally:
            cluster.close()
    env = {"EXTRA_PIP_PACKAGES": "optax"}
    created = {r["kind"]: r for r in fake.created}
    assert created["DaskCluster"] == kube.cluster_spec("daskdag", n_workers=3, env=env)
    assert created["DaskWorkerGroup"]["metadata"]["name"] == "daskdag-gpu"
    assert created["DaskWorkerGroup"]["spec"] == kube.worker_group(
        "daskdag", "gpu", kube.gpu_worker_spec("daskdag", n_workers=2, env=env))["spec"]
    assert created["DaskAutoscaler"]["spec"] == kube.autoscaler("daskdag", 1, 6)["spec"]
    assert fake.deleted == ["daskdag"]
    # A cluster that `kubectl apply` made: TLSKubeCluster.from_name connects to it over TLS,
    # and leaves it running when closed.
    with LocalCluster(n_workers=1, processes=False, protocol="tls://", security=servers,
                      dashboard_address="127.0.0.1:0", scheduler_sync_interval=3600) as local:
        local.scheduler.task_metadata.pop("cluster-manager-info", None)
        local.scheduler.remove_plugin(name="worker-status")
        port = int(local.scheduler_address.rsplit(":", 1)[1])
        fake = _FakeKube(port, local.scheduler.http_server.port, existing=_manifests()[0])
        fake.install(monkeypatch, kc)
        cluster = kube.TLSKubeCluster.from_name("daskdag", security=security(certs),
                                                namespace="test", quiet=True)
        try:
            assert cluster.scheduler_address == local.scheduler_address
            assert cluster.image == f"daskdag:{VERSION}" and cluster.n_workers == 2
            with Client(cluster, set_as_default=False) as client:
                assert client.submit(lambda v: v + 1, 41).result(timeout=30) == 42
        finally:
            cluster.close()
    assert fake.created == [] and fake.deleted == []

    # Outside a TLSKubeCluster's connecting, KubeCluster's rpc is plain distributed's.
    assert kc.rpc is original_rpc or kc.rpc("tcp://127.0.0.1:1").connection_args == {}


@pytest.mark.subprocess
def test_kustomize_builds_the_manifests():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    if out.returncode and "unknown command" in out.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert sorted(d["kind"] for d in docs) == ["DaskCluster", "DaskWorkerGroup"]


# ---------------------------------------------------------------------------------------------
# Slurm (dask-jobqueue)

def _import_slurm():
    from daskdag.deploy import slurm

    return slurm


def _worker_command(script: str) -> list[str]:
    line = [ln for ln in script.splitlines() if "distributed.cli.dask_worker" in ln]
    assert len(line) == 1, script
    argv = shlex.split(line[0])
    assert argv[1:3] == ["-m", "distributed.cli.dask_worker"]
    return argv


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_slurm_job_scripts_start_workers_with_their_resources(certs, tmp_path):
    slurm = _import_slurm()
    cluster = slurm.make_cluster(certs, account="acct", queue="cpu", gpu_queue="gpu", interface="lo",
                                 scheduler_options={"dashboard_address": "127.0.0.1:0"})
    procs = []
    try:
        address = cluster.slurm.scheduler_address
        assert address.startswith("tls://127.0.0.1:")
        scripts = cluster.job_scripts()
        cpu, gpu = scripts["cpu"], scripts["gpu"]
        assert "#SBATCH --gres=gpu:1" in gpu and "--gres" not in cpu
        assert "#SBATCH -p gpu" in gpu and "#SBATCH -p cpu" in cpu
        assert "#SBATCH -A acct" in gpu and "#SBATCH -A acct" in cpu
        assert "export JAX_PLATFORMS=cuda" in gpu and "export JAX_PLATFORMS=cpu" in cpu
        for kind, script in scripts.items():
            params = _parse_worker_args(_worker_command(script)[3:])
            assert params["scheduler"] == address
            assert (params["tls_ca_file"], params["tls_cert"], params["tls_key"]) == tuple(
                str((certs / f).resolve()) for f in CERT_FILES)
            assert params["resources"] == ("GPU=1" if kind == "gpu" else None)
            assert params["nthreads"] == (1 if kind == "gpu" else slurm.CPU_JOB["cores"])

        # Each script, run as Slurm would run it (here by bash, on this machine, the GPU job's
        # JAX on the CPU), starts a worker that joins over TLS with its resources.
        for kind, script in scripts.items():
            script = script.replace("--name dummy-name", f"--name {kind}-job")
            if not REAL_GPU:
                script = script.replace("JAX_PLATFORMS=cuda", "JAX_PLATFORMS=cpu")
            path = tmp_path / f"{kind}.sh"
            path.write_text(script)
            log = open(tmp_path / f"{kind}.log", "w")
            procs.append(subprocess.Popen(["bash", str(path)], env=_env(), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        with cluster.client() as client:
            try:
                client.wait_for_workers(2, timeout=90)
            except TimeoutError:
                logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
                pytest.fail(f"the job scripts' workers did not connect:\n{logs}")
            workers = {w["name"]: (a, w.get("resources")) for a, w in
                       live_workers(client).items()}
            assert workers["gpu-job"][1] == {"GPU": 1}
            assert not workers["cpu-job"][1]
            _run_gpu_dag(client, workers["gpu-job"][0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        cluster.close()


@pytest.mark.cluster  # (a Dask scheduler in this process)
@pytest.mark.timeout(120)
def test_slurm_scale_keeps_cpu_and_gpu_jobs_apart(certs, monkeypatch):
    """scale(cpu, gpu) sets each kind's number of jobs (submission itself is stubbed out)."""
    slurm = _import_slurm()
    cluster = slurm.make_cluster(certs, interface="lo",
                                 scheduler_options={"dashboard_address": "127.0.0.1:0"})
    try:
        reconciled = []
        monkeypatch.setattr(cluster.slurm, "scale", lambda jobs: reconciled.append(jobs))
        spec = cluster.slurm.worker_spec

        def kinds():
            return sorted("gpu" if s is cluster.gpu_spec else "cpu" for s in spec.values())

        cluster.scale(2, 1)
        assert kinds() == ["cpu", "cpu", "gpu"] and reconciled[-1] == 3
        cluster.scale(3, 2)
        assert kinds() == ["cpu"] * 3 + ["gpu"] * 2 and reconciled[-1] == 5
        cluster.scale(1, 0)
        assert kinds() == ["cpu"] and reconciled[-1] == 1
        options = cluster.gpu_spec["options"]
        assert options["worker_extra_args"] == ["--resources", "GPU=1"]
        assert options["security"].tls_worker_cert == str((certs / "cert.pem").resolve())
    finally:
        monkeypatch.undo()
        cluster.close()


JOBQUEUE_YAML = """\
jobqueue:
  slurm:
    cores: 3
    memory: 6GiB
    walltime: '00:07:00'
    account: yaml-acct
    queue: yaml-cpu
    job-extra-directives: ['--qos=low']
    job-script-prologue: ['module load site-python']
  slurm-gpu:
    memory: 20GiB
    job-cpu: 4
    queue: yaml-gpu
    job-extra-directives: ['--gres=gpu:a100:1']
"""


@pytest.fixture
def dask_config():
    """Dask's config as it was, restored after the test (which may refresh it from files);
    dask-jobqueue imported first, so that what it adds to the config at its import is kept
    (the first test to import it would take it away from the later ones)."""
    import copy

    import dask

    _import_slurm()
    before = copy.deepcopy(dask.config.config)
    yield dask.config
    dask.config.config.clear()
    dask.config.config.update(before)


def _directives(script: str) -> set[str]:
    return {ln.removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH")}


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_slurm_job_sizes_come_from_jobqueue_yaml_and_keywords_win(certs, tmp_path, dask_config):
    """The CPU jobs from jobqueue.yaml's ``slurm`` section, the GPU jobs from its ``slurm-gpu``
    section (what it leaves out from ``slurm``, then daskdag's GPU defaults); keywords win."""
    (tmp_path / "jobqueue.yaml").write_text(JOBQUEUE_YAML)
    dask_config.refresh(paths=[str(tmp_path)])  # as Dask reads ~/.config/dask/jobqueue.yaml
    slurm = _import_slurm()
    opts = {"interface": "lo", "scheduler_options": {"dashboard_address": "127.0.0.1:0"}}

    cluster = slurm.make_cluster(certs, **opts)
    try:
        scripts = cluster.job_scripts()
    finally:
        cluster.close()
    cpu, gpu = _directives(scripts["cpu"]), _directives(scripts["gpu"])
    assert {"--cpus-per-task=3", "--mem=6G", "-t 00:07:00", "-A yaml-acct", "-p yaml-cpu",
            "--qos=low"} <= cpu
    assert not any("gres" in d for d in cpu)
    # GPU: its own section, then the CPU section (walltime, account), then daskdag's defaults.
    assert {"--cpus-per-task=4", "--mem=20G", "-t 00:07:00", "-A yaml-acct", "-p yaml-gpu",
            "--gres=gpu:a100:1", "-J daskdag-gpu"} <= gpu
    assert "--qos=low" not in gpu
    cpu_args = _parse_worker_args(_worker_command(scripts["cpu"])[3:])
    gpu_args = _parse_worker_args(_worker_command(scripts["gpu"])[3:])
    assert cpu_args["nthreads"] == 3 and cpu_args["n_workers"] in (None, 1)  # processes: 1
    assert (gpu_args["nthreads"], gpu_args["resources"]) == (1, "GPU=1")
    # The site's prologue kept, JAX's platform added in front of it.
    assert "export JAX_PLATFORMS=cpu\nmodule load site-python" in scripts["cpu"]
    assert "export JAX_PLATFORMS=cuda\nexport XLA_PYTHON_CLIENT_PREALLOCATE=false" in scripts["gpu"]

    cluster = slurm.make_cluster(
        certs, account="kw-acct", gpu_queue="kw-gpu", **opts,
        cpu_job={"cores": 2, "walltime": "00:03:00", "job_script_prologue": []},
        gpu_job={"memory": "10GiB", "job_extra_directives": ["--gres=gpu:h100:2"],
                 "worker_extra_args": ["--lifetime", "50m"]})
    try:
        scripts = cluster.job_scripts()
    finally:
        cluster.close()
    cpu, gpu = _directives(scripts["cpu"]), _directives(scripts["gpu"])
    assert {"--cpus-per-task=2", "-t 00:03:00", "-A kw-acct", "-p yaml-cpu", "--mem=6G"} <= cpu
    assert {"--mem=10G", "-A kw-acct", "-p kw-gpu", "--gres=gpu:h100:2", "-t 00:07:00"} <= gpu
    assert "module load site-python" not in scripts["cpu"]
    gpu_args = _parse_worker_args(_worker_command(scripts["gpu"])[3:])
    assert (gpu_args["lifetime"], gpu_args["resources"]) == ("50m", "GPU=1")


# A stand-in for Slurm's commands, for adapt(): sbatch runs the job script with bash in a
# session of its own (the job id is its process id), scancel ends that session, squeue lists
# the sessions still running.
FAKE_SLURM = {
    "sbatch": """#!/bin/bash
cp "$1" "$FAKE_SLURM/job-$$.sh"
setsid bash "$FAKE_SLURM/job-$$.sh" > "$FAKE_SLURM/job-$$.log" 2>&1 < /dev/null &
echo "$!" >> "$FAKE_SLURM/submitted"
echo "Submitted batch job $!"
""",
    "scancel": """#!/bin/bash
for id in "$@"; do kill -TERM -- "-$id" 2>/dev/null; echo "$id" >> "$FAKE_SLURM/cancelled"; done
exit 0
""",
    "squeue": """#!/bin/bash
touch "$FAKE_SLURM/submitted"
while read -r id; do kill -0 "$id" 2>/dev/null && echo "$id"; done < "$FAKE_SLURM/submitted"
exit 0
""",
}


def _busy(i):
    time.sleep(2)
    return i


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_slurm_adapt_sizes_cpu_and_gpu_jobs_by_the_load(certs, tmp_path, monkeypatch, dask_config):
    """adapt(): idle, the GPU minimum and no CPU job; a daskdag call runs its GPU nodes on the
    GPU job; adapted again with higher GPU bounds, plain tasks bring CPU jobs up to ``maximum``, tasks needing a GPU bring GPU jobs up
    to ``gpu_maximum``; idle again, the jobs above the minimums are cancelled. Slurm's commands
    are stand-ins that run the job scripts here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("FAKE_SLURM", str(tmp_path))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    if not REAL_GPU:  # the GPU job's JAX on the CPU (its own prologue says so, and is kept)
        dask_config.set({"jobqueue.slurm-gpu.job-script-prologue": ["export JAX_PLATFORMS=cpu"]})
    slurm = _import_slurm()
    cluster = slurm.make_cluster(certs, interface="lo",
                                 scheduler_options={"dashboard_address": "127.0.0.1:0"},
                                 cpu_job={"cores": 1, "memory": "2GB"})
    spec = cluster.slurm.worker_spec

    def submitted():
        f = tmp_path / "submitted"
        return f.read_text().split() if f.exists() else []

    def running():
        out = subprocess.run([str(bin_dir / "squeue")], capture_output=True, text=True,
                             env=os.environ, check=True)
        return out.stdout.split()

    def jobs():  # (CPU jobs, GPU jobs) in the cluster's plan
        gpu = sum(1 for n in spec if str(n).startswith(f"{cluster.slurm.name}-gpu-"))
        return len(spec) - gpu, gpu

    def until(condition, what, timeout=120):
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what}: jobs {jobs()}, running {running()}"
            time.sleep(0.25)

    try:
        cluster.adapt(minimum=0, maximum=2, gpu_minimum=1, gpu_maximum=1, interval="500ms",
                      wait_count=3)
        cluster.wait_for_workers(gpu=1, timeout=120)
        time.sleep(2)
        assert jobs() == (0, 1) and len(submitted()) == 1

        with cluster.client() as client:
            dag, D = _gpu_dag()
            x = jnp.linspace(-1.0, 2.0, 5)
            with distributed.get_task_stream(client) as ts:
                res = daskdag.compute_grads(dag, x, ["D", "E"], client=client)
            assert_tree_close(res["D"].grad, jax.grad(D)(x), rtol=1e-4)
            with client.as_current():
                layers = daskdag.grads(dag, x, ["D", "E"]).__dask_graph__().layers.values()
            needs_gpu = {k for layer in layers
                         if "GPU" in ((layer.annotations or {}).get("resources") or {})
                         for k in layer}
            gpu = {a for a, w in live_workers(client).items() if w.get("resources") == {"GPU": 1}}
            placed = {t["worker"] for t in ts.data if t["key"] in needs_gpu}
            assert len(gpu) == 1 and placed == gpu

            cluster.adapt(minimum=0, maximum=2, gpu_minimum=1, gpu_maximum=2, interval="500ms",
                          wait_count=3)
            cpu_work = client.map(_busy, range(16), pure=False)
            gpu_work = client.map(_busy, range(100, 106), pure=False, resources={"GPU": 1})
            seen = set()
            until(lambda: seen.add(jobs()) or jobs() == (2, 2), "not scaled up to (2, 2)")
            assert client.gather(cpu_work + gpu_work) == [*range(16), *range(100, 106)]
            # Idle means no tasks and no results held: distributed keeps a worker holding
            # results that futures still reference.
            del cpu_work, gpu_work
            assert max(c for c, _ in seen) <= 2 and max(g for _, g in seen) <= 2
            until(lambda: jobs() == (0, 1) and len(running()) == 1, "not scaled down idle")
        cancelled = (tmp_path / "cancelled").read_text().split()
        assert len(submitted()) >= 4 and sorted(cancelled + running()) == sorted(submitted())
    finally:
        cluster.close()
        for pid in running():
            os.killpg(int(pid), 9)


# ---------------------------------------------------------------------------------------------
# A real Slurm: slurmctld and slurmd on this machine (Debian's slurm-wlm and munge, which
# .ci/run installs), jobs submitted with sbatch by CPUGPUCluster, killed at their --time.

SLURM_CONF = """\
ClusterName=daskdag-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=300
OverTimeLimit=0
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=8000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _daemon_logs(d) -> str:
    return "\n".join(f"--- {f.name}:\n{f.read_text(errors='replace')[-1500:]}"
                     for f in sorted(d.glob("*.log")) if f.stat().st_size)


@pytest.fixture
def slurm_daemons(tmp_path, monkeypatch):
    """munged, slurmctld and slurmd for this test alone (own sockets, ports, state), as root;
    ``SLURM_CONF`` set so that sbatch, squeue and scancel talk to them.

    Skipped only where Slurm cannot run at all: its programs missing, not runnable (``-V``), or
    the test not root (slurmd must be, to start jobs). Daemons that do not start with this
    test's configuration fail the test, with their logs: that is the set-up's fault."""
    tools = {t: shutil.which(t) or shutil.which(t, path="/usr/sbin:/sbin")
             for t in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")}
    missing = [t for t, p in tools.items() if p is None]
    if missing:
        pytest.skip(f"Slurm is not installed here ({', '.join(missing)} missing; .ci/run installs "
                    f"Debian's slurm-wlm and munge)")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs")
    for t in ("munged", "slurmctld", "slurmd"):
        try:
            version = subprocess.run([tools[t], "-V"], capture_output=True, text=True, timeout=30)
        except OSError as e:
            pytest.skip(f"{t} cannot run here: {e}")
        if version.returncode:
            pytest.skip(f"{t} cannot run here: {t} -V says {version.stderr.strip()[-300:]}")
    # Slurm's sockets live in its folders, and a socket's path is 108 bytes at most: a folder
    # of its own under the temporary directory (pytest's, under xdist, is too deep), its logs
    # copied to the test's tmp_path at the end.
    d = Path(tempfile.mkdtemp(prefix="slurm-"))
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(
        host=socket.gethostname().split(".")[0], user="root", dir=d, ctld_port=free_port(),
        d_port=free_port(), node="daskdagnode", cpus=os.cpu_count() or 2))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    started = []

    def output(name):  # each daemon's own output, beside its log, for a failure's message
        return open(d / f"{name}.out.log", "w")

    try:
        with output("munged") as out:
            started.append(subprocess.Popen(
                [tools["munged"], "--foreground", "--force", f"--socket={d}/munge.socket",
                 f"--pid-file={d}/munged.pid", f"--seed-file={d}/munge.seed",
                 f"--log-file={d}/munged.log"], stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 20
        while not (d / "munge.socket").exists():
            if started[0].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"munged did not start with the test's options:\n{_daemon_logs(d)}")
            time.sleep(0.1)
        for daemon, extra in (("slurmctld", ["-i"]), ("slurmd", ["-N", "daskdagnode"])):
            with output(daemon) as out:
                started.append(subprocess.Popen([tools[daemon], "-D", "-f", str(conf), *extra],
                                                stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run([tools["sinfo"], "--noheader", "--format=%t"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                pytest.fail(f"Slurm did not start with the test's slurm.conf (sinfo: "
                            f"{out.stdout.strip()} {out.stderr.strip()}):\n{_daemon_logs(d)}")
            time.sleep(0.5)
        yield d
    finally:
        subprocess.run([tools["scancel"], "--full", "--partition=test"], capture_output=True)
        for p in reversed(started):
            p.terminate()
        for p in reversed(started):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        (tmp_path / "slurm").mkdir()
        for log in d.glob("*.log"):
            shutil.copy(log, tmp_path / "slurm" / log.name)
        shutil.rmtree(d, ignore_errors=True)


SLURM_SWEEP_DAG = '''
import os, time
import jax.numpy as jnp


def h(x, w, i):
    time.sleep(0.3)
    with open({count!r}, "a") as f:
        f.write(f"{{int(i)}} {{os.environ.get('SLURM_JOB_ID', 'none')}}\\n")
    return jnp.tanh(x * w)


def loss(h):
    return jnp.sum(h ** 2)


DAG = {{"h": (h, ["x", "w", "i"]), "loss": (loss, ["h"])}}
'''


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_durable_sweep_outlives_its_slurm_jobs_time_limit(certs, slurm_daemons, tmp_path):
    """Real sbatch jobs with ``--time=1`` (minute) run a 2-minute sweep: Slurm kills them at
    their limit mid-sweep, ``CPUGPUCluster.keep`` submits new ones, and the same call completes;
    the same call again reads everything from the store and computes nothing."""
    import dask
    import numpy as np

    slurm = _import_slurm()
    count = tmp_path / "count"
    (tmp_path / "slurm_sweep_dag.py").write_text(SLURM_SWEEP_DAG.format(count=str(count)))
    sys.path.insert(0, str(tmp_path))
    try:
        import slurm_sweep_dag as m
    finally:
        sys.path.remove(str(tmp_path))
    items = 800
    xs = np.random.default_rng(5).uniform(0.1, 1.5, (items, 4)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 4, dtype=np.float32)
    logs = tmp_path / "jobs"
    cluster = slurm.make_cluster(
        certs, interface="lo", scheduler_options={"dashboard_address": "127.0.0.1:0"},
        cpu_job=dict(cores=1, memory="2GB", walltime="00:01:00", log_directory=str(logs)))

    def run(client):
        return daskdag.sweep_grads(m.DAG, {"x": xs, "w": w, "i": np.arange(items)}, "loss",
                                   batched=["x", "i"], chunk_size=8, client=client,
                                   store=tmp_path / "store")

    try:
        cluster.keep(2, 0, every=2.0)
        with cluster.client() as client, dask.config.set({"daskdag.worker-wait": "120s"}):
            client.wait_for_workers(2, timeout=120)
            res = run(client)
            lines = count.read_text().split("\n")
            again = run(client)  # everything from the store
    finally:
        cluster.close()
    assert count.read_text().split("\n") == lines, "the second call computed again"
    np.testing.assert_array_equal(np.asarray(again.value), np.asarray(res.value))
    np.testing.assert_array_equal(np.asarray(again.grad["x"]), np.asarray(res.grad["x"]))
    ref = jax.vmap(jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(x * w) ** 2)))(xs)
    np.testing.assert_allclose(np.asarray(res.value), np.asarray(ref[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(res.grad["x"]), np.asarray(ref[1]), rtol=1e-5, atol=1e-6)
    runs = [line.split() for line in lines if line]
    jobs = {job for _, job in runs}
    limited = {f.name.rsplit("-", 1)[-1].split(".")[0] for f in logs.glob("*.err")
               if "DUE TO TIME LIMIT" in f.read_text(errors="replace")}
    assert limited & jobs, "no job reached its time limit mid-sweep"
    assert jobs - limited, f"no new jobs were submitted: items ran in jobs {sorted(jobs)}"
    assert {int(i) for i, _ in runs} == set(range(items))
    # Computed twice: only items of chunks that a job reaching its limit had (sent to it, or
    # running there), at most the chunks in flight (2 per worker thread, 4 here) each time. A
    # chunk sent to such a job may have started in a new job once distributed moved it there,
    # and been cut short when the sweep sent it again: never one that finished in a job that
    # lived.
    first: dict[int, str] = {}
    twice, seen = [], set()
    for i, job in ((int(i), job) for i, job in runs):
        if i in first and first[i] not in limited:
            last = min((i // 8) * 8 + 7, items - 1)  # its chunk's last item
            assert (last, first[i]) not in seen, \
                f"item {i} computed again, though its chunk finished in job {first[i]}, which lived"
        if i in first:
            twice.append(i)
        first.setdefault(i, job)
        seen.add((i, job))
    assert len(twice) <= len(limited) * 4 * 8, f"{len(twice)} items computed again"
