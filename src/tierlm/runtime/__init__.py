"""The tiered training step."""

from tierlm.runtime.engine import Action, Engine, EngineOptions

__all__ = ["Action", "Engine", "EngineOptions"]
