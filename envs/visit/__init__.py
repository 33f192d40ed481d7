"""The visit tool: guarded fetch, main-text extraction, optional rendering and LLM extraction."""

from turnstile.envs.visit.tool import VisitConfig, VisitTool

__all__ = ["VisitConfig", "VisitTool"]
