"""GET /metrics on the HTTP API's port, as vLLM serves it beside /v1: the same samples (with `model_name`) that the
router's own metrics port serves (specfleet/metrics.py), so a scrape written for vLLM finds them where it looks. Where
the metrics port asks for a token (security.metrics_token), so does this route; the API key does not."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.openai_errors import ApiError
from specfleet.metrics import bearer_ok


def metrics_routes(collector, token: str = "") -> APIRouter:
    """`collector`: what the metrics port exposes (a registry, or specfleet.metrics.Labelled over one)."""
    routes = APIRouter()

    @routes.get("/metrics")
    async def metrics(request: Request):
        if not bearer_ok(request.headers.get("authorization", "").encode("latin-1"), token):
            raise ApiError(401, "metrics need Authorization: Bearer <security.metrics_token>", code="invalid_metrics_token")
        return Response(generate_latest(collector), media_type=CONTENT_TYPE_LATEST)

    return routes
