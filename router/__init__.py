"""Ingress: OpenAI HTTP and gRPC on Ray Serve (``server``), request validation
(``validation``), admission, response shapes (``openai_api``, ``grpc_api``), placement
policies and the dispatcher that runs requests over the worker pools."""
