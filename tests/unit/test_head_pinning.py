"""Pinning the controller and the router to the Ray head with a custom resource only the
head advertises (the Helm chart's ``head.pinResource``), and asking for none when it is
not configured (``tandem up``, where no node offers it). No Ray is started: the actor
options are read where ``cluster.service`` hands them to Ray."""

from __future__ import annotations

import types

import pytest

import cluster.service as service
from cluster.service import HEAD_RESOURCE_UNITS, ServiceConfig, head_pinned, router_deployment
from router.server import SAME_LOOP, Router


def test_no_resource_is_asked_for_unless_one_is_configured():
    assert ServiceConfig().head_resource is None  # tandem up: schedules as before
    assert head_pinned(None) == {} and head_pinned("") == {}
    assert head_pinned("tandem_head") == {"resources": {"tandem_head": HEAD_RESOURCE_UNITS}}
    assert router_deployment(None) is Router and router_deployment("") is Router


def test_the_pinned_router_keeps_its_other_actor_options():
    pinned = router_deployment("tandem_head")
    options = pinned.ray_actor_options
    assert options["resources"] == {"tandem_head": HEAD_RESOURCE_UNITS}
    assert options["num_cpus"] == 0
    assert options["runtime_env"]["env_vars"] == SAME_LOOP
    assert "resources" not in (Router.ray_actor_options or {})  # the module's deployment is untouched


class _FakeRay:
    """Records the options the app builder gives the controller actor."""

    def __init__(self):
        self.options: dict | None = None

    def remote(self, cls):
        fake = self

        class _Actor:
            def options(self, **kwargs):
                fake.options = kwargs
                return self

            def remote(self, *args, **kwargs):
                return types.SimpleNamespace(start=types.SimpleNamespace(remote=lambda start_timeout_s=None: "started"))

        return _Actor()

    def get(self, ref, timeout=None):
        assert ref == "started"
        return {}


@pytest.mark.parametrize("head_resource", [None, "tandem_head"])
def test_the_app_builder_pins_controller_and_router_only_when_args_name_a_resource(monkeypatch, head_resource):
    fake = _FakeRay()
    monkeypatch.setattr(service, "ray", fake)
    monkeypatch.setattr(service, "check_environment", lambda ingress, environ: None)
    monkeypatch.setattr(service, "retire_other_controllers", lambda keep: [])
    args = {"topology": {"prefill_workers": 1, "decode_workers": 1}, "ingress": "haproxy"}
    if head_resource:
        args["head_resource"] = head_resource
    app = service.app(args)
    deployment_options = app._bound_deployment.ray_actor_options
    if head_resource:
        assert fake.options["resources"] == {head_resource: HEAD_RESOURCE_UNITS}
        assert deployment_options["resources"] == {head_resource: HEAD_RESOURCE_UNITS}
    else:
        assert "resources" not in fake.options
        assert "resources" not in deployment_options
    assert fake.options["num_cpus"] == 0 and fake.options["lifetime"] == "detached"
