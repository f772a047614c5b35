"""The operator dashboard, served by the app itself (``docs/dashboard.md``)."""

from api.dashboard.routes import router

__all__ = ["router"]
