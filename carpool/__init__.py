"""carpool: an LLM inference server built around the economics of serving.

`from carpool import LLM, SamplingParams` is the library; both load on first use (PEP 562), so that `import
carpool.cli` does not load the kernels before the command line can say why a forced kernel path cannot run.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from carpool.llm import LLM

        return LLM
    if name == "SamplingParams":
        from carpool.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")
