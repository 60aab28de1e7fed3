"""The model runner: paged KV cache, prefix caching, continuous batching (no gRPC here)."""

from mooncaked.engine.config import ConfigError, EngineConfig, ModelConfig
from mooncaked.engine.llm_engine import Engine
from mooncaked.engine.step_records import EngineStats
from mooncaked.engine.outputs import Output
from mooncaked.engine.sampling_params import RequestError, SamplingParams

__all__ = ["ConfigError", "Engine", "EngineConfig", "EngineStats", "ModelConfig", "Output", "RequestError",
           "SamplingParams"]
