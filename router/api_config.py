"""The OpenAI API's settings (``ApiConfig``), apart from the router's core, so the service's
flags (``cluster.flags``) read their defaults without Ray."""

from __future__ import annotations

from dataclasses import dataclass

from router.reasoning import check_reasoning_setting


@dataclass(frozen=True)
class ApiConfig:
    """What the OpenAI API reads of chat outputs and keeps of responses: the reasoning
    parser (``router.reasoning``: ``auto`` reads the thinking of models whose chat
    template thinks, ``none`` never, or a parser by name) and how many Responses API
    responses a replica stores (``router.response_store``; 0: none)."""

    reasoning_parser: str = "auto"
    max_stored_responses: int = 1024

    def __post_init__(self) -> None:
        check_reasoning_setting(self.reasoning_parser)
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
