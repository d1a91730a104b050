"""Structured JSON logging for every service (structlog), carrying run/execution/cell ids as context."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def configure_logging(service: str, *, level: str | None = None, run_id: str | None = None) -> None:
    """Route structlog and stdlib logging to JSON lines on stderr, tagged with the service name; at `level`, or
    the run's GYRE_LOG_LEVEL (INFO when unset)."""
    global _configured
    level = (level or os.environ.get("GYRE_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **({"run_id": run_id} if run_id else {}))
    _configured = True


def get_logger(**ids: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to ids such as run_id, execution_id, cell_id, step."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger().bind(**ids)
    return logger
