"""specmla: an inference engine and Triton kernel library for Multi-head Latent Attention models."""

from specmla.config import ModelConfig

__all__ = ["ModelConfig", "LLM", "SamplingParams", "load_model"]
__version__ = "0.1.0"


def __getattr__(name):  # keep `import specmla` light: the engine loads on first use
    if name == "LLM":
        from specmla.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specmla.sampling_params import SamplingParams

        return SamplingParams
    if name == "load_model":
        from specmla.model.loader import load_model

        return load_model
    raise AttributeError(name)
