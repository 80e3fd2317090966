"""Interface definitions (.proto) and their generated Python stubs."""
