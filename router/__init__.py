"""Ingress: request dispatch over the worker pools, placement policies (HTTP/gRPC next)."""
