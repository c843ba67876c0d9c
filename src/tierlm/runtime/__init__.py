"""The tiered training step."""

from tierlm.runtime.engine import Action, Engine, build_engine
from tierlm.runtime.plan import EngineOptions, StepPlan, plan_step

__all__ = ["Action", "Engine", "EngineOptions", "StepPlan", "build_engine", "plan_step"]
