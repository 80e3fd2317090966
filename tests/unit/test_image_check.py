"""scripts/image-check and the Dockerfile settings it relies on, checked without building:
the base image and torch's index are build arguments whose defaults keep a plain
`docker build` as it was, and the script's translation of this machine's pip settings
into the build's /etc/pip.conf and read-only mounts."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
SCRIPT = REPO / "scripts" / "image-check"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _torch_install(flavour: str) -> str:
    """The shell command of the Dockerfile's RUN line that installs torch."""
    lines = (DOCKER / f"Dockerfile.{flavour}").read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("RUN pip install") and "torch==" in x]
    return line.removeprefix("RUN ")


def _pip_args(command: str, env: dict[str, str]) -> list[str]:
    """The arguments `pip` gets when the RUN line runs in a shell with these build args."""
    script = 'pip() { printf "%s\\n" "$@"; }\n' + command
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_cpu_dockerfile_takes_its_base_as_a_build_arg_defaulting_to_python_slim():
    text = (DOCKER / "Dockerfile.cpu").read_text()
    before_from, _, _ = text.partition("\nFROM ")
    (default,) = re.findall(r"^ARG BASE=(\S+)$", before_from, re.M)
    assert default == "python:3.11-slim"
    assert re.findall(r"^FROM (.+)$", text, re.M) == ["${BASE}"]


@pytest.mark.parametrize(
    ("flavour", "default"), [("cpu", CPU_INDEX), ("gpu", "https://download.pytorch.org/whl/cu128")]
)
def test_torch_index_defaults_to_pytorchs_and_an_empty_one_leaves_pip_its_settings(flavour, default):
    text = (DOCKER / f"Dockerfile.{flavour}").read_text()
    assert re.findall(r"^ARG TORCH_INDEX_URL=(\S+)$", text, re.M) == [default]
    command = _torch_install(flavour)
    env = {"TORCH_VERSION": "2.13.0", "PATH": "/usr/bin:/bin"}
    assert _pip_args(command, {**env, "TORCH_INDEX_URL": default}) == ["install", "torch==2.13.0", "--index-url", default]
    assert _pip_args(command, {**env, "TORCH_INDEX_URL": ""}) == ["install", "torch==2.13.0"]


def test_script_parses_and_rejects_an_unknown_argument():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "--severity=info", str(SCRIPT)], check=True)
    out = subprocess.run([str(SCRIPT), "--no-such-flag"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown argument --no-such-flag" in out.stderr


def _pip_settings(tmp_path: Path, pip_conf: str, env: dict[str, str], skip: str = "") -> tuple[dict, list[str]]:
    """Runs the script's pip_settings with this pip config file and environment (pip loads
    it after the machine's own files, which the callers' keys therefore override)."""
    config = tmp_path / "host-pip.conf"
    config.write_text(pip_conf)
    work = tmp_path / "work"
    environ = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "PIP_CONFIG_FILE": str(config), **env}
    python = Path(shutil.which("python3")).parent  # the pip that the script asks: this one's
    environ["PATH"] = f"{python}:{environ['PATH']}"
    out = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; work="{work}"; pip_settings "{skip}"'],
        env=environ, capture_output=True, text=True, check=True,
    )
    parser = configparser.ConfigParser()
    parser.read(work / "pip" / "pip.conf")
    return dict(parser["global"]), out.stdout.splitlines()


def test_pip_settings_become_the_builds_pip_conf_with_local_paths_mounted(tmp_path):
    index, wheels, cert = tmp_path / "simple", tmp_path / "wheels", tmp_path / "ca.pem"
    index.mkdir(), wheels.mkdir(), cert.write_text("")
    conf = f"[global]\nextra-index-url = file://{index} https://example.invalid/simple\nfind-links = /nonexistent\n"
    settings, mounts = _pip_settings(tmp_path, conf, {"PIP_FIND_LINKS": str(wheels), "PIP_CERT": str(cert)})
    assert {k: settings[k] for k in ("extra-index-url", "find-links", "cert")} == {
        "extra-index-url": f"file://{index} https://example.invalid/simple",
        "find-links": str(wheels),  # the environment wins over the file, as in pip
        "cert": "/opt/pip-host/cert.pem",  # apart from the image's own CA bundle
    }
    ours = [m for m in mounts if m.startswith(str(tmp_path))]
    assert sorted(ours) == sorted([f"{tmp_path}:{tmp_path}:ro", f"{wheels}:{wheels}:ro", f"{cert}:/opt/pip-host/cert.pem:ro"])


def test_pip_settings_skip_the_keys_asked(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    settings, mounts = _pip_settings(tmp_path, "[global]\ntimeout = 60\n", {"PIP_FIND_LINKS": str(wheels)}, skip="find-links")
    assert settings["timeout"] == "60"
    assert "find-links" not in settings
    assert not [m for m in mounts if m.startswith(str(tmp_path))]
