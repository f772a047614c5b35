"""The operator dashboard, served by the app itself (``docs/dashboard.md``).

``router`` holds the pages and their assets (open: they hold no data) and the one read route
the fleet map polls, ``GET /v1/dashboard/cells`` (``read`` scope).
"""

from fastapi import APIRouter

from api.dashboard import cells, routes

__all__ = ["router"]

router = APIRouter()
router.include_router(routes.router)
router.include_router(cells.router)
